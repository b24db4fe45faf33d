#!/bin/sh
# Make sure the browser test has a Chromium: Debian's package, installed with apt-get when
# running as root. Never fails the build: without a browser the test skips and says why.
for name in chromium chromium-browser; do
    command -v "$name" >/dev/null 2>&1 && exit 0
done
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "Installing Debian's chromium for the browser test..."
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
        >/dev/null 2>&1; then
        echo "Could not install chromium: the browser test will skip." >&2
    fi
else
    echo "No chromium, and not root to install it: the browser test will skip." >&2
fi
exit 0
