"""kvrouter's Python client: RL rollout headers, OpenAI-compatible calls with provenance, the
router-run weight-update cycle, and a helper that runs ``kvrouter serve`` for tests.

Layout: ``headers`` (request headers), ``client`` (calls and answers), ``stream`` (streamed
answers), ``admin`` (admin API and weight updates), ``provenance`` (response headers and the
provenance log), ``pick`` (the pick API's answers), ``errors`` (typed errors), ``server`` (the subprocess helper).
"""

from .admin import AdminClient, PolicyStatus, UpdateCycle, UpdateMode, WorkerPolicy
from .client import AsyncKvrouterClient, Completion
from .errors import (
    AuthenticationError,
    BadRequestError,
    ConflictError,
    GatewayTimeoutError,
    KvrouterError,
    NotFoundError,
    OverloadedError,
    ServerStartError,
    ServiceUnavailableError,
    TransportError,
    UpstreamError,
    WeightUpdateError,
    WeightUpdateTimeout,
)
from .headers import RolloutHeaders
from .pick import Pick, PickEvent, PickStatus, report_entry
from .provenance import Provenance, ProvenanceRecord, fingerprint_version, read_provenance_log, wait_for_provenance
from .server import KvrouterServer, find_binary, free_port
from .stream import Stream

__all__ = [
    "AdminClient",
    "AsyncKvrouterClient",
    "AuthenticationError",
    "BadRequestError",
    "Completion",
    "ConflictError",
    "GatewayTimeoutError",
    "KvrouterError",
    "KvrouterServer",
    "NotFoundError",
    "OverloadedError",
    "Pick",
    "PickEvent",
    "PickStatus",
    "PolicyStatus",
    "Provenance",
    "ProvenanceRecord",
    "RolloutHeaders",
    "ServerStartError",
    "ServiceUnavailableError",
    "Stream",
    "UpdateCycle",
    "UpdateMode",
    "TransportError",
    "UpstreamError",
    "WeightUpdateError",
    "WeightUpdateTimeout",
    "WorkerPolicy",
    "find_binary",
    "fingerprint_version",
    "free_port",
    "read_provenance_log",
    "report_entry",
    "wait_for_provenance",
]
__version__ = "0.1.0"
