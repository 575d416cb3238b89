#!/usr/bin/env bash
# Assembles the root filesystem of the kvrouter image in DIR: the binary (debug info stripped) at
# /usr/local/bin/kvrouter, exactly the shared libraries it links (as `ldd` lists them, at the
# same paths), /etc/passwd and /etc/group naming the non-root user kvrouter (65532), and /tmp.
# Needs nothing from a registry: build.sh turns DIR into an image FROM scratch.
#
#   deploy/image/rootfs.sh BINARY DIR
set -euo pipefail
bin="${1:?usage: rootfs.sh BINARY DIR}"
dir="${2:?usage: rootfs.sh BINARY DIR}"
[ -x "$bin" ] || { echo "rootfs.sh: $bin is not an executable" >&2; exit 1; }
command -v ldd >/dev/null || { echo "rootfs.sh: ldd not found" >&2; exit 1; }
rm -rf "$dir"
mkdir -p "$dir/usr/local/bin" "$dir/etc" "$dir/tmp"
chmod 1777 "$dir/tmp"
strip --strip-debug -o "$dir/usr/local/bin/kvrouter" "$bin" 2>/dev/null || cp "$bin" "$dir/usr/local/bin/kvrouter"
# "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" and "/lib64/ld-linux-x86-64.so.2 (0x...)"
libs=$(ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' | sort -u)
[ -n "$libs" ] || { echo "rootfs.sh: ldd listed no libraries for $bin (a static binary needs none; check)" >&2; }
for lib in $libs; do
    mkdir -p "$dir$(dirname "$lib")"
    cp -L "$lib" "$dir$lib"
done
printf 'hosts: files dns\n' >"$dir/etc/nsswitch.conf"
printf 'root:x:0:0:root:/:/sbin/nologin\nkvrouter:x:65532:65532:kvrouter:/tmp:/sbin/nologin\n' >"$dir/etc/passwd"
printf 'root:x:0:\nkvrouter:x:65532:\n' >"$dir/etc/group"
echo "rootfs.sh: $dir: kvrouter and $(echo "$libs" | wc -w) libraries, $(du -sh "$dir" | cut -f1)"
