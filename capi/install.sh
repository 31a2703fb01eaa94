#!/usr/bin/env bash
# Installs the C ABI of moe-ep under PREFIX:
#   PREFIX/include/moe_ep.h
#   PREFIX/lib/libmoe_ep.so.<major>.<abi>   (SONAME libmoe_ep.so.<major>)
#   PREFIX/lib/libmoe_ep.so.<major> -> libmoe_ep.so.<major>.<abi>
#   PREFIX/lib/libmoe_ep.so         -> libmoe_ep.so.<major>
#   PREFIX/lib/libmoe_ep.a
#   PREFIX/lib/pkgconfig/moe_ep.pc
#   PREFIX/lib/cmake/moe_ep/moe_epConfig.cmake, moe_epConfigVersion.cmake
# <major> is ABI_MAJOR of capi/build.rs, <abi> MOE_EP_ABI_VERSION of the
# header; <major>.<abi> is also the version of the pkg-config and CMake
# packages (a caller needing ABI N of major M asks for M.N).
#
#   capi/install.sh [--profile NAME] [--target-dir DIR] PREFIX
#       builds `cargo build -p moe-ep-capi --profile NAME` (release by
#       default; dev for the debug build) into DIR (CARGO_TARGET_DIR, or
#       target/ of the checkout), then installs;
#   capi/install.sh --lib-dir DIR PREFIX
#       installs libmoe_ep.so and libmoe_ep.a of DIR without building.
# DESTDIR, where set, is put before every path written (staged installs);
# the files name PREFIX.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
profile=release
target_dir=${CARGO_TARGET_DIR:-$root/target}
lib_dir=
usage() { sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile=${2:?--profile NAME}; shift 2 ;;
    --target-dir) target_dir=${2:?--target-dir DIR}; shift 2 ;;
    --lib-dir) lib_dir=${2:?--lib-dir DIR}; shift 2 ;;
    -h|--help) usage ;;
    -*) echo "install.sh: unknown option $1" >&2; usage ;;
    *) break ;;
  esac
done
[ $# -eq 1 ] || usage
prefix=$1
case "$prefix" in /*) ;; *) prefix=$(pwd)/$prefix ;; esac
prefix=${prefix%/}

if [ -z "$lib_dir" ]; then
  cargo build --manifest-path "$root/Cargo.toml" -p moe-ep-capi --profile "$profile" \
    --target-dir "$target_dir" >&2
  case "$profile" in dev|test) lib_dir=$target_dir/debug ;; bench) lib_dir=$target_dir/release ;; *) lib_dir=$target_dir/$profile ;; esac
fi
for f in libmoe_ep.so libmoe_ep.a; do
  [ -f "$lib_dir/$f" ] || { echo "install.sh: $lib_dir/$f not found" >&2; exit 1; }
done

major=$(sed -n 's/^const ABI_MAJOR: u32 = \([0-9][0-9]*\);$/\1/p' "$here/build.rs")
abi=$(sed -n 's/^#define MOE_EP_ABI_VERSION \([0-9][0-9]*\)$/\1/p' "$here/include/moe_ep.h")
[ -n "$major" ] && [ -n "$abi" ] || { echo "install.sh: no ABI_MAJOR / MOE_EP_ABI_VERSION" >&2; exit 1; }
version=$major.$abi
soname=libmoe_ep.so.$major
real=libmoe_ep.so.$version
# What the Rust staticlib needs beside it: `cargo rustc -p moe-ep-capi --lib
# --crate-type staticlib -- --print native-static-libs` on
# x86_64-unknown-linux-gnu prints -ldl -lc -lm -lrt -lpthread -lgcc_s -lutil
# -lrt -lpthread -lm -ldl -lc; these are its libraries once each, in the
# order of their last mention.
static_libs=(gcc_s util rt pthread m dl c)
cmake_libs=$(IFS=';'; echo "${static_libs[*]}")

dest=${DESTDIR:-}$prefix
install -d "$dest/include" "$dest/lib/pkgconfig" "$dest/lib/cmake/moe_ep"
install -m 644 "$here/include/moe_ep.h" "$dest/include/moe_ep.h"
rm -f "$dest/lib/$real" "$dest/lib/$soname" "$dest/lib/libmoe_ep.so"
install -m 755 "$lib_dir/libmoe_ep.so" "$dest/lib/$real"
ln -s "$real" "$dest/lib/$soname"
ln -s "$soname" "$dest/lib/libmoe_ep.so"
install -m 644 "$lib_dir/libmoe_ep.a" "$dest/lib/libmoe_ep.a"

cat > "$dest/lib/pkgconfig/moe_ep.pc" <<EOF
prefix=$prefix
libdir=\${prefix}/lib
includedir=\${prefix}/include

Name: moe_ep
Description: moe-ep C ABI: expert-parallel dispatch and combine GPU kernels (ABI $abi)
Version: $version
Cflags: -I\${includedir}
Libs: -L\${libdir} -lmoe_ep
Libs.private: ${static_libs[*]/#/-l}
EOF

cat > "$dest/lib/cmake/moe_ep/moe_epConfig.cmake" <<EOF
# The C ABI of moe-ep (written by capi/install.sh).
#   find_package(moe_ep $version REQUIRED)
#   target_link_libraries(app PRIVATE moe_ep::moe_ep)         # $soname
#   target_link_libraries(app PRIVATE moe_ep::moe_ep_static)  # libmoe_ep.a
# The version is <ABI major>.<ABI version>: a caller of ABI N asks for $major.N.
get_filename_component(_moe_ep_prefix "\${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
set(moe_ep_ABI_VERSION $abi)
set(moe_ep_INCLUDE_DIRS "\${_moe_ep_prefix}/include")
if(NOT TARGET moe_ep::moe_ep)
  add_library(moe_ep::moe_ep SHARED IMPORTED)
  set_target_properties(moe_ep::moe_ep PROPERTIES
    IMPORTED_LOCATION "\${_moe_ep_prefix}/lib/$real"
    IMPORTED_SONAME "$soname"
    INTERFACE_INCLUDE_DIRECTORIES "\${_moe_ep_prefix}/include")
endif()
if(NOT TARGET moe_ep::moe_ep_static)
  add_library(moe_ep::moe_ep_static STATIC IMPORTED)
  set_target_properties(moe_ep::moe_ep_static PROPERTIES
    IMPORTED_LOCATION "\${_moe_ep_prefix}/lib/libmoe_ep.a"
    IMPORTED_LINK_INTERFACE_LANGUAGES "C"
    INTERFACE_INCLUDE_DIRECTORIES "\${_moe_ep_prefix}/include"
    INTERFACE_LINK_LIBRARIES "$cmake_libs")
endif()
set(moe_ep_LIBRARIES moe_ep::moe_ep)
unset(_moe_ep_prefix)
EOF

cat > "$dest/lib/cmake/moe_ep/moe_epConfigVersion.cmake" <<EOF
# Version $version = <ABI major>.<ABI version> (written by capi/install.sh):
# compatible with a request of the same major and an ABI version not above
# this one's; 64-bit only.
set(PACKAGE_VERSION "$version")
set(PACKAGE_VERSION_COMPATIBLE FALSE)
set(PACKAGE_VERSION_EXACT FALSE)
if(NOT PACKAGE_FIND_VERSION)
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
elseif(PACKAGE_FIND_VERSION_MAJOR STREQUAL "$major"
       AND NOT PACKAGE_FIND_VERSION VERSION_GREATER PACKAGE_VERSION)
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
  if(PACKAGE_FIND_VERSION VERSION_EQUAL PACKAGE_VERSION)
    set(PACKAGE_VERSION_EXACT TRUE)
  endif()
endif()
if(CMAKE_SIZEOF_VOID_P AND NOT CMAKE_SIZEOF_VOID_P STREQUAL "8")
  set(PACKAGE_VERSION "$version (64-bit)")
  set(PACKAGE_VERSION_UNSUITABLE TRUE)
endif()
EOF
echo "installed moe_ep $version ($soname) under $dest" >&2
