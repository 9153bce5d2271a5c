# Dockerfile — moonbox's container images, built from Debian 12 packages only.
#
#   build     compiles moonbox with cmake (the -dev packages live only here) and installs it
#             into /out/usr with `cmake --install`.
#   local     `moonbox run` on the embedded local backend (real sandboxes in the container):
#             the runtime plus slirp4netns, nftables and mmdebstrap (the sandbox image); runs as
#             root in a privileged container (user namespaces, idmapped mounts, cgroups).
#             `--target local`; see docs/deploy.md.
#   schedule  (the default, last stage) `moonbox schedule` against Render's cloud: the shared
#             libraries moonbox links, lua-cjson, CA certificates and time zones; runs
#             `moonbox schedule /etc/moonbox/schedule.lua --backend render` as the unprivileged
#             user moonbox (uid 10001), its state in the volume /var/lib/moonbox. What
#             render.yaml deploys.
#
# Each stage starts with its package installation, so that a layer cache keeps the packages
# across source changes. `buildah bud -t moonbox .` or `docker build -t moonbox .`.

# What moonbox needs at run time: the libraries `ldd` names for the binary and its archive
# module, the Lua JSON module, CA certificates for HTTPS and the zone database for cron's tz.
ARG RUNTIME_PACKAGES="liblua5.4-0 libcurl4 libev4 libmicrohttpd12 libsqlite3-0 libedit2 \
libarchive13 zlib1g libpq5 lua-cjson ca-certificates tzdata"

FROM debian:12 AS build
RUN export DEBIAN_FRONTEND=noninteractive \
 && apt-get update \
 && apt-get install -y --no-install-recommends \
      build-essential cmake pkg-config liblua5.4-dev libcurl4-openssl-dev libev-dev \
      libmicrohttpd-dev libsqlite3-dev libarchive-dev zlib1g-dev libedit-dev libseccomp-dev \
      musl-tools \
      libpq-dev \
      lua-cjson \
 && rm -rf /var/lib/apt/lists/*
# lua-cjson: the build runs the moonbox it built to write the editor annotations from the
# schema (tools/luacats.lua), and moonbox loads cjson at start.
WORKDIR /src
COPY . .
# Everything is built (not only the binary): `cmake --install` needs every target its install
# lists name, whichever modules and programs those lists grow to.
RUN cmake -S . -B /build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_INSTALL_PREFIX=/usr \
 && cmake --build /build -j"$(nproc)" \
 && DESTDIR=/out cmake --install /build --strip

FROM debian:12 AS local
ARG RUNTIME_PACKAGES
RUN export DEBIAN_FRONTEND=noninteractive \
 && apt-get update \
 && apt-get install -y --no-install-recommends $RUNTIME_PACKAGES \
      slirp4netns nftables mmdebstrap util-linux \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/usr/ /usr/
ENV XDG_STATE_HOME=/var/lib/moonbox XDG_CACHE_HOME=/var/cache/moonbox
VOLUME ["/var/lib/moonbox", "/var/cache/moonbox"]
WORKDIR /var/lib/moonbox
# With no RENDER_API_KEY, `moonbox run RECIPE` uses the embedded local backend; `moonbox local`
# itself listens on the container's loopback only, as everywhere.
ENTRYPOINT ["moonbox"]
CMD ["help"]

FROM debian:12 AS schedule
ARG RUNTIME_PACKAGES
RUN export DEBIAN_FRONTEND=noninteractive \
 && apt-get update \
 && apt-get install -y --no-install-recommends $RUNTIME_PACKAGES \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --user-group --no-log-init --home-dir /var/lib/moonbox --create-home \
      --shell /usr/sbin/nologin moonbox
COPY --from=build /out/usr/ /usr/
# The recipe whose schedules the image fires by default (mount another over it, or build with
# --build-arg SCHEDULE_RECIPE=path/in/the/repo.lua). RENDER_API_KEY comes from the environment
# at run time, never from the image.
ARG SCHEDULE_RECIPE=recipes/rebuild_schedule.lua
COPY ${SCHEDULE_RECIPE} /etc/moonbox/schedule.lua
ENV XDG_STATE_HOME=/var/lib/moonbox
VOLUME ["/var/lib/moonbox"]
WORKDIR /var/lib/moonbox
USER moonbox
ENTRYPOINT ["moonbox"]
CMD ["schedule", "/etc/moonbox/schedule.lua", "--backend", "render"]
