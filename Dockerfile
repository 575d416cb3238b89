# The kvrouter image for users with registry access (CI builds an equivalent image FROM scratch
# without a registry: deploy/image/build.sh; docs/deploy.md has both).
#
#   docker build -t kvrouter .
#   docker run --rm -p 8000:8000 kvrouter serve --mock-workers 2
#
# Build stage: the release binary (zeromq-src and jemalloc need the C/C++ toolchain the rust
# image has; the ext_proc service's code is generated with protoc, which it lacks).
FROM docker.io/library/rust:1-bookworm AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends protobuf-compiler \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p kvrouter \
    && strip --strip-debug target/release/kvrouter \
    && cp target/release/kvrouter /kvrouter

# Runtime: Debian slim (glibc, libstdc++, libgcc as linked), a non-root user, nothing else.
FROM docker.io/library/debian:bookworm-slim
RUN groupadd --gid 65532 kvrouter \
    && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin kvrouter
COPY --from=build /kvrouter /usr/local/bin/kvrouter
USER 65532:65532
WORKDIR /tmp
# Every flag is also a KVROUTER_<FLAG> variable; in a container the router listens on all
# interfaces.
ENV KVROUTER_HOST=0.0.0.0
EXPOSE 8000
ENTRYPOINT ["/usr/local/bin/kvrouter"]
CMD ["serve", "--mock-workers", "2"]
