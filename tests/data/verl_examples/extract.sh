#!/usr/bin/env bash
# Re-extracts the test data here from verl's launch scripts (copied beside their .args): each script runs for real in bash (its
# variables, arithmetic and arrays evaluated by bash itself) with `python3` / `python` replaced by a
# stand-in that writes the arguments of the launch (`python3 -m verl.trainer.main_ppo ...`, also
# behind `ray job submit -- ...`) one per line, and ray / cp / nvidia-smi / downloads stubbed out.
# Usage: extract.sh VERL_CHECKOUT VERL_RECIPE_CHECKOUT (at the commits SOURCE.md names).
set -euo pipefail
verl=$1 recipe=$2
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/bin"
cat > "$work/bin/python3" <<'SHIM'
#!/bin/bash
if [ "$1" = "-m" ]; then printf '%s\n' "${@:3}" > "$VERL_ARGS_OUT"; fi  # drops "-m <module>"
exit 0
SHIM
cat > "$work/bin/ray" <<'SHIM'
#!/bin/bash
while [ $# -gt 0 ] && [ "$1" != "--" ]; do shift; done
[ "${1:-}" = "--" ] && shift && "$@"
exit 0
SHIM
cp "$work/bin/python3" "$work/bin/python"
for stub in cp nvidia-smi huggingface-cli hf pip wandb; do printf '#!/bin/bash\nexit 0\n' > "$work/bin/$stub"; done
chmod +x "$work/bin/"*

extract() {  # script, output file
  cp "$1" "${2%.args}.sh"  # the script itself, which `config from-verl SCRIPT` reads without running it
  # Ascend's environment script is sourced by the NPU examples; it does not exist here
  sed 's#^source /usr/local/Ascend.*#: Ascend set_env skipped#' "$1" > "$work/script.sh"
  rm -f "$2"
  (cd "$work" && HOME=/home/user RAY_DATA_HOME=/home/user/verl VERL_ARGS_OUT="$2" \
     PATH="$work/bin:/usr/bin:/bin" timeout 20 bash "$work/script.sh" > "$work/log" 2>&1) || true
  [ -s "$2" ] || { echo "no launch found in $1:"; tail -n 3 "$work/log"; }
}
mkdir -p "$here/grpo_trainer" "$here/dapo"
for script in "$verl"/examples/grpo_trainer/*.sh; do
  extract "$script" "$here/grpo_trainer/$(basename "$script" .sh).args"
done
for script in "$recipe"/dapo/*.sh; do
  case "$(basename "$script")" in prepare_*) continue ;; esac
  extract "$script" "$here/dapo/$(basename "$script" .sh).args"
done
