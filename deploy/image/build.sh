#!/usr/bin/env bash
# Builds the kvrouter image FROM scratch with buildah, with no registry access: the root
# filesystem from rootfs.sh (the binary and the libraries it links), user 65532, entrypoint
# kvrouter, listening on all interfaces (KVROUTER_HOST=0.0.0.0). Optionally also writes it as
# an OCI archive that `podman load` / `docker load` / `skopeo copy` take elsewhere.
#
#   deploy/image/build.sh [BINARY [TAG [OCI_ARCHIVE]]]
#   defaults: target/release/kvrouter localhost/kvrouter:latest (no archive)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="${1:-target/release/kvrouter}"
tag="${2:-localhost/kvrouter:latest}"
archive="${3:-}"
command -v buildah >/dev/null || { echo "build.sh: buildah not found (Debian: apt-get install buildah)" >&2; exit 1; }
rootfs="$(dirname "$bin")/image-rootfs"
"$here/rootfs.sh" "$bin" "$rootfs"
version="$("$bin" --version | awk '{print $2}')"
ctr=$(buildah from scratch)
trap 'buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
buildah copy --quiet "$ctr" "$rootfs" / >/dev/null
buildah config \
    --entrypoint '["/usr/local/bin/kvrouter"]' --cmd 'serve --mock-workers 2' \
    --user 65532:65532 --workingdir /tmp --port 8000 \
    --env KVROUTER_HOST=0.0.0.0 \
    --label org.opencontainers.image.title=kvrouter \
    --label org.opencontainers.image.version="$version" \
    --label org.opencontainers.image.description="KV-cache-aware router for LLM inference" \
    "$ctr"
buildah commit --quiet --rm "$ctr" "$tag" >/dev/null
trap - EXIT
echo "build.sh: $tag ($version) built FROM scratch"
if [ -n "$archive" ]; then
    rm -f "$archive"
    buildah push --quiet "$tag" "oci-archive:$archive:$tag"
    echo "build.sh: $archive ($(du -h "$archive" | cut -f1))"
fi
