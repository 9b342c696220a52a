# A container image with the `efabus` command and libfabric from the
# distribution.
#
#   docker build -t efabus .
#   docker run --rm -p 7420:7420 -p 8222:8222 efabus \
#       serve --listen tcp/0.0.0.0:7420 --monitor 0.0.0.0:8222
#
# On an EFA host, pass the device and lift the locked-memory limit, with
# the host network so that peers reach the fabric address directly:
#
#   docker run --rm --network host --device /dev/infiniband/uverbs0 \
#       --ulimit memlock=-1:-1 -v /etc/efabus:/etc/efabus:ro efabus \
#       serve --config /etc/efabus/efabus.toml
#
# Distribution libfabric packages may not include the efa provider (see
# "Running on EFA" in README.md); an image for EFA then builds on the AWS
# EFA installer's libfabric instead. efabus loads libfabric when a fabric
# endpoint first needs it: an image without libfabric1 serves on TCP, its
# fabric listeners saying why they cannot open.

FROM rust:1-bookworm AS build
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       libfabric-dev pkg-config make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release -p efabus-cli

FROM debian:bookworm-slim
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       libfabric1 ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/efabus /usr/local/bin/efabus
COPY config/default.toml /etc/efabus/efabus.toml
EXPOSE 7420 8222
USER nobody
ENTRYPOINT ["/usr/local/bin/efabus"]
CMD ["serve", "--listen", "tcp/0.0.0.0:7420", "--monitor", "0.0.0.0:8222"]
