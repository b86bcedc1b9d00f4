#!/usr/bin/env bash
# The offline AMD toolchain of the native kernels (qsa_aiter/runtime/jit/hip_clang.py), on a Debian machine without
# an AMD GPU:
#   - Debian's clang-22, lld-22 and llvm-22 (apt-get install, as root or through sudo), from the machine's own suites;
#   - the HIP headers (libamdhip64-dev) and the AMDGPU device bitcode (rocm-device-libs-N, N <= 22), the newest that
#     Debian unstable / experimental have, downloaded through a private apt configuration that reads the mirror of
#     this machine's apt sources and unpacked (dpkg-deb -x: nothing installed, the system's apt setup unchanged) into
#     $QSA_AITER_HIP_SDK, default ${HIP_COMPILE_HOME:-${TMPDIR:-/tmp}/hip-compile}/sdk: where hip_clang looks first.
#
#   bash .ci/amd-toolchain.sh        # prints clang's path and the SDK directory with its packages
#
# Idempotent: a run that finds both in place checks them and returns in about a second. Exit status: 0 ready; 1 it
# could not be set up (the message says what was missing); 2 bad usage.
set -euo pipefail

LLVM=22  # hip_clang.LLVM_VERSION (tests/test_ci.py checks that they agree)
HOME_DIR=${HIP_COMPILE_HOME:-${TMPDIR:-/tmp}/hip-compile}
SDK=${QSA_AITER_HIP_SDK:-$HOME_DIR/sdk}

die() { echo "amd-toolchain: $*" >&2; exit 1; }
case "${1:-}" in
    "") ;;
    -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "amd-toolchain: unknown argument $1 (it takes none; --help says what it does)" >&2; exit 2 ;;
esac

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"
    elif command -v sudo >/dev/null; then sudo "$@"
    else die "installing clang-$LLVM needs root or sudo"; fi
}

# 1. clang, lld and the llvm tools (llvm-readelf reads the code objects' metadata).
bindir() { command -v "llvm-config-$LLVM" >/dev/null && "llvm-config-$LLVM" --bindir; }
llvm_ready() {
    local bin; bin=$(bindir 2>/dev/null) || return 1
    [ -x "$bin/clang" ] && [ -x "$bin/ld.lld" ] && [ -x "$bin/llvm-readelf" ]
}
if ! llvm_ready; then
    packages=("clang-$LLVM" "lld-$LLVM" "llvm-$LLVM")
    echo "amd-toolchain: installing ${packages[*]} (apt-get)" >&2
    install=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${packages[@]}")
    if ! as_root "${install[@]}" >/dev/null 2>&1; then  # a fresh machine's package lists may be empty or old
        as_root apt-get update -q >/dev/null || die "apt-get update failed"
        as_root "${install[@]}" >&2 || die "could not install ${packages[*]}: this Debian suite has no clang $LLVM"
    fi
    llvm_ready || die "llvm-config-$LLVM --bindir has no clang, ld.lld and llvm-readelf after the install"
fi
BIN=$(bindir)

# 2. The HIP headers and the device bitcode for gfx942 and gfx950.
sdk_ready() {
    [ -f "$SDK/.packages" ] && [ -f "$SDK/include/hip/hip_runtime.h" ] \
        && [ -f "$SDK/amdgcn/bitcode/oclc_isa_version_942.bc" ] && [ -f "$SDK/amdgcn/bitcode/oclc_isa_version_950.bc" ]
}
mirror() {  # the Debian mirror of the machine's apt sources (deb822 or one-line style)
    local file uri
    for file in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$file" ] || continue
        for uri in $(sed -n -e 's/^URIs:[[:space:]]*//p' \
                 -e 's/^deb[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\{0,1\}\([^[:space:]]*\).*/\2/p' "$file"); do
            case "$uri" in */debian|*/debian/) echo "${uri%/}"; return 0 ;; esac
        done
    done
    return 1
}
fetch_sdk() {
    local url apt signed="" keyring=/usr/share/keyrings/debian-archive-keyring.gpg
    url=$(mirror) || die "no Debian mirror in /etc/apt/sources* to fetch the HIP packages from"
    apt=$HOME_DIR/apt
    rm -rf "$apt"
    mkdir -p "$apt/lists/partial" "$apt/archives/partial" "$apt/deb" "$apt/x"
    [ -f "$keyring" ] && signed="[signed-by=$keyring] "
    printf 'deb %s%s unstable main\ndeb %s%s experimental main\n' "$signed" "$url" "$signed" "$url" \
        > "$apt/sources.list"
    local opts=(-o "Dir::Etc::sourcelist=$apt/sources.list" -o "Dir::Etc::sourceparts=-"
                -o "Dir::Etc::preferencesparts=-" -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt"
                -o "Dir::Cache::archives=$apt/archives" -o "APT::Architecture=amd64" -o "APT::Architectures=amd64"
                -o "Acquire::Languages=none" -o "APT::Sandbox::User=$(id -un)" -o "Debug::NoLocking=1")
    echo "amd-toolchain: fetching the HIP headers and AMDGPU device bitcode (Debian unstable / experimental, $url)" >&2
    apt-get "${opts[@]}" -q update > "$apt/update.log" 2>&1 \
        || { cat "$apt/update.log" >&2; die "apt-get update of the private unstable / experimental lists failed"; }
    newest() { apt-cache "${opts[@]}" madison "$1" 2>/dev/null | awk -F'|' '{gsub(/ /, "", $2); print $2}' \
                   | sort -V | tail -1 || true; }
    local hip bitcode="" n v
    hip=$(newest libamdhip64-dev)
    [ -n "$hip" ] || die "Debian unstable / experimental have no libamdhip64-dev"
    for n in $(seq "$LLVM" -1 19); do  # device bitcode of an older LLVM reads in a newer clang, not the other way
        v=$(newest "rocm-device-libs-$n")
        if [ -n "$v" ]; then bitcode="rocm-device-libs-$n=$v"; break; fi
    done
    [ -n "$bitcode" ] || die "Debian unstable / experimental have no rocm-device-libs-N for N <= $LLVM"
    (cd "$apt/deb" && apt-get "${opts[@]}" -q download "libamdhip64-dev=$hip" "$bitcode" > "$apt/download.log" 2>&1) \
        || { cat "$apt/download.log" >&2; die "apt-get download of libamdhip64-dev=$hip $bitcode failed"; }
    local deb found
    for deb in "$apt"/deb/*.deb; do dpkg-deb -x "$deb" "$apt/x"; done
    found=$(find "$apt/x" -name oclc_isa_version_950.bc | head -1)
    [ -n "$found" ] && [ -f "$(dirname "$found")/oclc_isa_version_942.bc" ] \
        || die "$bitcode has no device bitcode for gfx942 and gfx950"
    local major
    major=$(sed -n 's/^#define HIP_VERSION_MAJOR \([0-9]*\).*/\1/p' "$apt/x/usr/include/hip/hip_version.h")
    [ "${major:-0}" -ge 7 ] \
        || die "libamdhip64-dev=$hip is HIP ${major:-?}: clang $LLVM needs the headers of HIP 7 or newer"
    rm -rf "$SDK.new"
    mkdir -p "$SDK.new/amdgcn"
    cp -r "$apt/x/usr/include" "$SDK.new/include"
    cp -r "$(dirname "$found")" "$SDK.new/amdgcn/bitcode"
    printf 'libamdhip64-dev=%s\n%s\n' "$hip" "$bitcode" > "$SDK.new/.packages"
    rm -rf "$SDK"
    mv "$SDK.new" "$SDK"
    rm -rf "$apt"
}

mkdir -p "$HOME_DIR" "$(dirname "$SDK")"
exec 9>"$HOME_DIR/.lock"
flock 9  # one setup at a time (CI jobs sharing a machine)
sdk_ready || fetch_sdk
sdk_ready || die "$SDK is incomplete after the download"
flock -u 9

echo "clang: $BIN/clang ($("$BIN/clang" --version | head -1))"
echo "sdk: $SDK ($(paste -sd' ' "$SDK/.packages"))"
