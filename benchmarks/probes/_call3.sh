eval "$(bash .whl/install.sh)" >/dev/null 2>&1 || exit 1
export FLASHTRAIN_KERNEL_CACHE=/tmp/kc HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
timeout 200 python -m flashtrain.kernels.build -j 16 > $OUT/build.log 2>&1; echo build rc=$?; tail -2 $OUT/build.log; date -u
timeout 60 python benchmarks/probes/prebuild_mask_mod.py sm_90a > $OUT/prebuild.log 2>&1; echo prebuild rc=$?; date -u
timeout 320 python -m pytest -q -m cuda --maxfail=20 tests/ > $OUT/cuda_tests.log 2>&1; echo tests rc=$?; tail -15 $OUT/cuda_tests.log; date -u
