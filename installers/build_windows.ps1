# Build the Windows app folder (dist\minecart\minecart.exe) with PyInstaller, from the repository root:
#   powershell -ExecutionPolicy Bypass -File installers\build_windows.ps1 [-Cuda cuda12|cuda13|none]
# Needs Python 3.10+ on PATH. Creates .venv-build (kept out of the repo's .venv) and a Start-menu shortcut.
param([string]$Cuda = "cuda12")
$ErrorActionPreference = "Stop"
Set-Location (Join-Path $PSScriptRoot "..")
if (-not (Test-Path .venv-build)) { python -m venv .venv-build }
$py = ".venv-build\Scripts\python.exe"
& $py -m pip install -q --upgrade pip
$extras = "demo"
if ($Cuda -ne "none") { $extras = "demo,$Cuda" }
& $py -m pip install -q -e ".[$extras]" pyinstaller
& $py -m PyInstaller --noconfirm --clean installers\minecart.spec
$exe = Resolve-Path "dist\minecart\minecart.exe"
$lnk = Join-Path ([Environment]::GetFolderPath("Programs")) "minecart.lnk"
$shell = New-Object -ComObject WScript.Shell
$sc = $shell.CreateShortcut($lnk)
$sc.TargetPath = $exe
$sc.WorkingDirectory = Split-Path $exe
$sc.Save()
Write-Host "Built $exe; Start-menu shortcut: $lnk"
