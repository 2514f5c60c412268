#!/usr/bin/env bash
# CPython 3.14 and 3.15 for the Python matrix: Debian unstable (sid) ships them (python3.14,
# python3.15 with -venv and -dev), but they need sid's C library, so they run in a sid root made
# with debootstrap and entered with chroot. Needs root.
#
#   bash scripts/sid_root.sh setup           make the root once (a stamp says it is ready)
#   bash scripts/sid_root.sh run CMD ARGS... make it if needed, mount, run CMD in it, unmount
#
# The root is cached outside any clone (DLBRIDGE_SID_ROOT, default /var/cache/dlbridge-sid) so a
# second run, or CI's fresh clone on the same machine, does not set up again. `run` bind-mounts the
# checkout at its own path (so paths agree inside and out), the host's Rust toolchain (~/.rustup,
# ~/.cargo, read-only), /proc, /dev, a tmpfs /dev/shm (multiprocessing and Ray need it) and every
# directory named in SID_BINDS (read-only, at the same path: e.g. the CUDA libraries of .venv), and
# undoes every mount it made when CMD ends, fails or is interrupted.
set -euo pipefail
root_dir=${DLBRIDGE_SID_ROOT:-/var/cache/dlbridge-sid}
mirror=${DLBRIDGE_SID_MIRROR:-http://deb.debian.org/debian}
# What the root holds; a change here makes the next run set it up again.
packages="python3.14 python3.14-venv python3.14-dev python3.15 python3.15-venv python3.15-dev g++ make git"
stamp="$root_dir/.dlbridge-ready"
checkout=$(cd "$(dirname "$0")/.." && pwd)

# The host's CA bundle and pip settings, so pip inside reaches PyPI as on the host.
copy_host_config() {
  local r=$1 f
  cp /etc/resolv.conf "$r/etc/resolv.conf" 2>/dev/null || true
  mkdir -p "$r/etc/ssl/certs"
  [[ -f /etc/ssl/certs/ca-certificates.crt ]] && cp /etc/ssl/certs/ca-certificates.crt "$r/etc/ssl/certs/"
  for f in /etc/pip.conf "$HOME/.config/pip/pip.conf" "$HOME/.pip/pip.conf"; do
    [[ -f "$f" ]] && mkdir -p "$r$(dirname "$f")" && cp "$f" "$r$f"
  done
  return 0
}

setup() {
  [[ -f "$stamp" && "$(cat "$stamp")" == "$packages" ]] && return 0
  [[ $(id -u) == 0 ]] || { echo "sid_root: making the sid root needs root" >&2; exit 1; }
  local t0=$SECONDS
  echo "== sid root: setting up $root_dir (debootstrap, then $packages)"
  if ! command -v debootstrap >/dev/null; then
    apt-get update -qq
    apt-get install -y -qq debootstrap >/dev/null
  fi
  local tmp="$root_dir.partial"
  umount_all "$tmp"
  rm -rf "$tmp" "$root_dir"
  mkdir -p "$(dirname "$root_dir")"
  debootstrap --variant=minbase sid "$tmp" "$mirror" >"$tmp.log" 2>&1 \
    || { tail -20 "$tmp.log" >&2; echo "sid_root: debootstrap failed (log: $tmp.log)" >&2; exit 1; }
  copy_host_config "$tmp"
  # The mirror's sid Release file can be past its Valid-Until date on a machine whose clock runs
  # ahead of the mirror's last sync: apt would then refuse the package lists.
  echo 'Acquire::Check-Valid-Until "false";' >"$tmp/etc/apt/apt.conf.d/99dlbridge"
  (
    trap 'umount_all "$tmp"' EXIT
    mount -t proc proc "$tmp/proc"
    # shellcheck disable=SC2086
    chroot "$tmp" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
      sh -c "apt-get update -qq && apt-get install -y -qq --no-install-recommends $packages >/dev/null && apt-get clean"
  )
  rm -f "$tmp.log"
  mv "$tmp" "$root_dir"
  echo "$packages" >"$stamp"
  echo "== sid root: ready in $((SECONDS - t0)) s ($(du -sh "$root_dir" | cut -f1))"
}

# Every mount under $1, deepest first, lazily (a process still holding one cannot keep it).
umount_all() {
  local r m
  r=$(realpath -m "$1")
  awk -v r="$r" '$2 == r || index($2, r "/") == 1 { print $2 }' /proc/self/mounts | sort -r \
    | while read -r m; do umount -l "$m" 2>/dev/null || true; done
}

bind() { # bind SRC [ro]: SRC at the same path inside the root
  local src=$1 dst="$root_dir$1"
  mkdir -p "$dst"
  mount --bind "$src" "$dst"
  # Private: where the host's mounts are shared (systemd's default), a mount made beneath the
  # bind (the tmpfs on dev/shm) would otherwise appear over the host's own directory too.
  mount --make-private "$dst"
  [[ "${2:-}" == ro ]] && mount -o remount,bind,ro "$dst"
  return 0
}

run() {
  setup
  copy_host_config "$root_dir"
  trap 'umount_all "$root_dir"' EXIT
  umount_all "$root_dir" # a run killed before its trap could run left them
  mount -t proc proc "$root_dir/proc"
  bind /dev
  mount -t tmpfs -o mode=1777 tmpfs "$root_dir/dev/shm"
  [[ -d /dev/pts ]] && bind /dev/pts
  local rustup=${RUSTUP_HOME:-$HOME/.rustup} cargo=${CARGO_HOME:-$HOME/.cargo} d
  bind "$rustup" ro
  bind "$cargo" ro
  bind "$checkout"
  for d in ${SID_BINDS:-}; do bind "$d" ro; done
  [[ -d "${PIP_FIND_LINKS:-}" ]] && bind "$PIP_FIND_LINKS" ro
  # Cargo's own files (registry, git checkouts) go to a writable home inside the root, seeded from
  # the host's read-only one so nothing already downloaded is fetched again.
  local envs=(PATH="$cargo/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin" HOME=/root LANG=C.UTF-8
    RUSTUP_HOME="$rustup" CARGO_HOME=/var/cache/cargo-home TMPDIR=/tmp)
  mkdir -p "$root_dir/var/cache/cargo-home"
  [[ -d "$cargo/registry" && ! -e "$root_dir/var/cache/cargo-home/registry" ]] \
    && cp -a "$cargo/registry" "$root_dir/var/cache/cargo-home/registry"
  local v
  while IFS='=' read -r v _; do
    case "$v" in PIP_* | RUSTUP_TOOLCHAIN | RUSTUP_AUTO_INSTALL | MATRIX* | CARGO_TERM_* | PYTHONWARNINGS) envs+=("$v=${!v}") ;; esac
  done < <(env)
  # In the background, in a process group of its own, and waited for: an interrupt or a TERM to
  # this script is passed to every process of the command, and the mounts go at once (bash runs
  # traps only between commands).
  setsid chroot "$root_dir" /usr/bin/env -i "${envs[@]}" DLBRIDGE_IN_SID_ROOT=1 "$@" <&0 9>&- &
  child=$!
  trap 'kill -INT -- "-$child" 2>/dev/null; exit 130' INT
  trap 'kill -TERM -- "-$child" 2>/dev/null; exit 143' TERM
  local rc=0
  wait "$child" || rc=$?
  return $rc
}

# One set-up or run at a time on the machine (two clones' `make test` share the root and its mounts).
exec 9>"$root_dir.lock"
flock 9
case "${1:-}" in
  setup) setup ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 setup | run CMD [ARGS...]" >&2; exit 2 ;;
esac
