# Sourced by the GPU probe scripts (issue14_gpu.sh, issue20_gpu.sh): the repository root as the working directory,
# $OUT (the first argument, else $OUT, else the default $1 of `probe_setup`), the offline / kernel-cache environment,
# and `step NAME COMMAND...`, which runs COMMAND with its log in $OUT/NAME.log and remembers a failure in $status.
probe_setup() {  # probe_setup DEFAULT_OUT [OUT]
  cd "$(dirname "${BASH_SOURCE[0]}")/../.."
  OUT=${2:-${OUT:-$1}}
  mkdir -p "$OUT"
  export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
  export FLASHTRAIN_KERNEL_CACHE=${FLASHTRAIN_KERNEL_CACHE:-$OUT/kernel-cache}
  status=0
}
step() {  # step NAME COMMAND...: run, log to $OUT/NAME.log, remember a failure
  local name=$1; shift
  echo "== $name: $*"
  "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  tail -n 6 "$OUT/$name.log"; echo "== $name rc=$rc"
  [ $rc -eq 0 ] || status=1
}
