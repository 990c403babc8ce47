eval "$(bash .whl/install.sh)" >/dev/null 2>&1 || exit 1
export FLASHTRAIN_KERNEL_CACHE=/tmp/kc HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u
python -m flashtrain.kernels.build -j 16 --only '_mods|hdim(128|512)_bf16_causal|flash_aux' > $OUT/build.log 2>&1; echo build rc=$?
timeout 330 python benchmarks/attention_features.py --out $OUT/attention_features-h200.json > $OUT/features.txt 2>&1; echo features rc=$?; tail -9 $OUT/features.txt
date -u
timeout 150 python benchmarks/probes/feature_breakdown.py --only "window" --out $OUT/breakdown.json > $OUT/breakdown.txt 2>&1; echo bd rc=$?; cut -c1-120 $OUT/breakdown.txt | grep -v Warn
date -u
