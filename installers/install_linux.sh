#!/usr/bin/env bash
# Per-user Linux desktop integration: menu entry and icon for the `minecart` command on PATH.
#   pip install "minecart[demo,cuda12]" && installers/install_linux.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
apps="${XDG_DATA_HOME:-$HOME/.local/share}/applications"
icons="${XDG_DATA_HOME:-$HOME/.local/share}/icons/hicolor/scalable/apps"
mkdir -p "$apps" "$icons"
install -m 644 "$here/minecart.desktop" "$apps/minecart.desktop"
install -m 644 "$here/../resources/icons/logo.svg" "$icons/minecart.svg"
command -v update-desktop-database >/dev/null && update-desktop-database "$apps" || true
command -v minecart >/dev/null || echo "note: 'minecart' is not on PATH yet; activate the environment you installed it in"
echo "installed $apps/minecart.desktop"
