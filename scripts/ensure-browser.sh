#!/usr/bin/env bash
# The admin console's browser tests drive Debian's chromium through its chromedriver (tests/support/browser.py).
# In CI (CI=true) this installs both packages; elsewhere it says what is missing and how to install it.
set -euo pipefail
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
  exit 0
fi
if [ "${CI:-}" = "true" ]; then
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends chromium chromium-driver
  exit 0
fi
echo "the console's browser tests need chromium and chromedriver (/usr/bin/chromium, /usr/bin/chromedriver):" >&2
echo "  sudo apt-get install chromium chromium-driver" >&2
echo "(make test installs them itself when CI=true)" >&2
exit 1
