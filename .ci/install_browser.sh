#!/usr/bin/env bash
# Install what the web UI's browser tests (tests/test_webui_browser.py) need on a fresh Debian machine:
# Debian's Chromium and its matching chromedriver, and the Selenium bindings. No browser is downloaded by a
# Python package (Selenium is given /usr/bin/chromedriver, so its driver manager never runs).
# Idempotent: does nothing that is already done. Run as root (or with sudo available).
set -euo pipefail

SELENIUM_VERSION="${SELENIUM_VERSION:-4.51.0}"
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver fonts-liberation
fi

if ! python -c "import selenium, sys; sys.exit(selenium.__version__ != '${SELENIUM_VERSION}')" 2>/dev/null; then
    python -m pip install -q "selenium==${SELENIUM_VERSION}"
fi

chromium --version
chromedriver --version
python -c "import selenium; print('selenium', selenium.__version__)"
