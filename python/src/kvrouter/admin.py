"""The admin API (``--admin-token``): worker states and policy versions, and the router-run
weight-update cycle (``POST /admin/policy/update``, progress at ``GET /admin/policy``)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio

from .errors import AuthenticationError, WeightUpdateError, WeightUpdateTimeout
from ._transport import Transport

UpdateMode = Literal["drain", "abort", "rolling"]

#: Default bound on waiting for a weight-update cycle (a large model loads for minutes).
DEFAULT_UPDATE_TIMEOUT_S = 900.0
#: Default interval between two reads of ``GET /admin/policy`` while waiting.
DEFAULT_POLL_S = 0.05


@dataclass(frozen=True)
class WorkerPolicy:
    id: int
    policy_version: int
    #: ``serving``, ``draining``, ``updating``, ``paused`` or ``unhealthy``.
    state: str


@dataclass(frozen=True)
class UpdateCycle:
    """The running (or last) weight-update cycle."""

    version: int
    mode: str
    batch: int
    running: bool
    done: int
    total: int
    #: Worker id → ``pending``, ``draining``, ``updating``, ``loaded``, ``done`` or ``failed``.
    phases: dict[int, str]
    elapsed_ms: float

    @property
    def failed(self) -> list[int]:
        return sorted(w for w, p in self.phases.items() if p == "failed")


@dataclass(frozen=True)
class PolicyStatus:
    """``GET /admin/policy``."""

    newest_policy_version: int
    kv_retention: str
    workers: list[WorkerPolicy]
    update: UpdateCycle | None
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> PolicyStatus:
        u = body.get("update")
        cycle = None
        if isinstance(u, dict):
            cycle = UpdateCycle(
                version=int(u["version"]),
                mode=str(u["mode"]),
                batch=int(u["batch"]),
                running=bool(u["running"]),
                done=int(u["done"]),
                total=int(u["total"]),
                phases={int(k): str(v) for k, v in (u.get("phases") or {}).items()},
                elapsed_ms=float(u["elapsed_ms"]),
            )
        return cls(
            newest_policy_version=int(body["newest_policy_version"]),
            kv_retention=str(body["kv_retention"]),
            workers=[WorkerPolicy(int(w["id"]), int(w["policy_version"]), str(w["state"])) for w in body["workers"]],
            update=cycle,
            raw=body,
        )

    def versions(self) -> dict[int, int]:
        """Worker id → the policy version it serves."""
        return {w.id: w.policy_version for w in self.workers}


class AdminClient:
    """``client.admin``: every call sends ``Authorization: Bearer <admin_token>``."""

    def __init__(self, transport: Transport, token: str | None) -> None:
        self._transport = transport
        self._token = token

    def auth_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self._token}"} if self._token else {}

    async def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        if not self._token:
            raise AuthenticationError("no admin token: pass admin_token= to AsyncKvrouterClient", type="authentication_error")
        return await self._transport.json(method, "/admin" + path, json=body, headers=self.auth_headers())

    async def policy(self) -> PolicyStatus:
        """``GET /admin/policy``: each worker's version and state, and the update cycle."""
        return PolicyStatus.from_json(await self._call("GET", "/policy"))

    async def workers(self) -> list[dict[str, Any]]:
        """``GET /admin/workers``: each worker's entry, state, version, load and cached blocks."""
        workers: list[dict[str, Any]] = (await self._call("GET", "/workers"))["workers"]
        return workers

    async def add_worker(self, url: str, **entry: Any) -> int:
        """``POST /admin/workers``: registers an engine (``url``, plus any workers-file field:
        ``kv_events_endpoint``, ``policy_version``, ``engine``, ...); returns its id. A URL
        already registered is a :class:`kvrouter.ConflictError`."""
        body = await self._call("POST", "/workers", {"url": url, **entry})
        return int(body["id"])

    async def remove_worker(self, worker: int) -> None:
        """``DELETE /admin/workers/{id}``."""
        await self._call("DELETE", f"/workers/{worker}")

    async def pause_worker(self, worker: int) -> None:
        """Takes a worker out of rotation without marking it failed (elastic membership)."""
        await self._call("POST", f"/workers/{worker}/pause")

    async def resume_worker(self, worker: int) -> None:
        await self._call("POST", f"/workers/{worker}/resume")

    async def set_policy_version(self, worker: int, version: int) -> None:
        """Records that a worker loaded ``version`` by other means than the update cycle."""
        await self._call("POST", f"/workers/{worker}/policy-version", {"version": version})

    async def trace(self) -> dict[str, Any]:
        """``GET /admin/trace`` (``--trace-capture N``): Chrome trace JSON for Perfetto."""
        return await self._call("GET", "/trace")

    async def start_weight_update(
        self,
        version: int,
        *,
        mode: UpdateMode = "drain",
        batch: int | None = None,
        workers: Sequence[int] | None = None,
        load_path: str | None = None,
        load_body: Mapping[str, Any] | None = None,
    ) -> None:
        """``POST /admin/policy/update``; returns once the router accepted it (202). A cycle
        already running is a :class:`kvrouter.ConflictError`; a bad field a
        :class:`kvrouter.BadRequestError` naming it. ``load_path``/``load_body``: the engine's
        weight-load call (e.g. SGLang needs ``load_body={"model_path": ...}``)."""
        body: dict[str, Any] = {"version": version, "mode": mode}
        if batch is not None:
            body["batch"] = batch
        if workers is not None:
            body["workers"] = list(workers)
        load: dict[str, Any] = {}
        if load_path is not None:
            load["path"] = load_path
        if load_body is not None:
            load["body"] = dict(load_body)
        if load:
            body["load"] = load
        await self._call("POST", "/policy/update", body)

    async def wait_weight_update(
        self,
        version: int,
        *,
        timeout_s: float = DEFAULT_UPDATE_TIMEOUT_S,
        poll_s: float = DEFAULT_POLL_S,
    ) -> PolicyStatus:
        """Polls ``GET /admin/policy`` until the cycle to ``version`` has finished; returns the
        final status. Raises :class:`kvrouter.WeightUpdateError` when it finished with failed
        workers (they stay ``paused`` with their old weights; ``resume_worker`` puts them back)
        or the router's cycle is for another version, and :class:`kvrouter.WeightUpdateTimeout`
        when it still runs after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = await self.policy()
            cycle = status.update
            if cycle is None or cycle.version != version:
                found = "none" if cycle is None else f"version {cycle.version}"
                raise WeightUpdateError(
                    f"no weight-update cycle to version {version} at the router (its cycle: {found})",
                    status=status.raw,
                )
            if not cycle.running:
                if cycle.failed:
                    raise WeightUpdateError(
                        f"weight update to version {version}: workers {cycle.failed} failed "
                        "(left paused with their old weights)",
                        status=status.raw,
                    )
                return status
            if time.monotonic() >= deadline:
                raise WeightUpdateTimeout(
                    f"weight update to version {version} still running after {timeout_s} s "
                    f"({cycle.done} of {cycle.total} workers done; phases {cycle.phases})",
                    status=status.raw,
                )
            await anyio.sleep(poll_s)

    async def update_weights(
        self,
        version: int,
        *,
        mode: UpdateMode = "drain",
        batch: int | None = None,
        workers: Sequence[int] | None = None,
        load_path: str | None = None,
        load_body: Mapping[str, Any] | None = None,
        timeout_s: float = DEFAULT_UPDATE_TIMEOUT_S,
        poll_s: float = DEFAULT_POLL_S,
    ) -> PolicyStatus:
        """Starts a weight-update cycle and waits for it (see :meth:`start_weight_update` and
        :meth:`wait_weight_update`)."""
        await self.start_weight_update(
            version, mode=mode, batch=batch, workers=workers, load_path=load_path, load_body=load_body
        )
        return await self.wait_weight_update(version, timeout_s=timeout_s, poll_s=poll_s)
