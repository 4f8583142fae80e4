#!/usr/bin/env bash
# One device call: build, every gpu and mpi test but the long fault sweep, quick benchmarks,
# moe_train's balance runs. Everything goes to $OUT as it happens.
set -uo pipefail
source scripts/common.sh
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
exec > >(tee "$OUT/run.txt") 2>&1
nvidia-smi -L
moe_install_deps >/dev/null 2>&1
t=$SECONDS
moe_build -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "build $((SECONDS - t)) s, warnings: $(grep -cE 'warning( #[0-9]+-D)?:' "$OUT/build.log")"
grep -m5 -E 'warning( #[0-9]+-D)?:' "$OUT/build.log"
cd build
ctest -L '^gpu$' --output-on-failure >/tmp/gpu.log 2>&1
grep -E "Test +#|tests passed" /tmp/gpu.log
grep -B2 -A14 -E "^[^ ].*: FAILED:" /tmp/gpu.log | sed 's/\x1b\[[0-9;]*m//g' | head -60
ctest -L '^mpi$' -E 'fault_injection.npall|[.]np1$' --output-on-failure >/tmp/mpi.log 2>&1
grep -E "Test +#|tests passed|PASS: the job|FAIL:" /tmp/mpi.log
grep -B2 -A14 -E "^[^ ].*: FAILED:" /tmp/mpi.log | sed 's/\x1b\[[0-9;]*m//g' | head -60
cd ..
B=build/apps/moe_bench
show='^(moe_bench|throughput|host per step|forward \+ backward|capacity mode|device memory|NVLink)'
echo "== moe_bench, 2 GPUs"
mpirun -np 2 --bind-to none -x NCCL_NVLS_ENABLE $B --iters 10 >/tmp/b2.txt 2>&1; grep -E "$show" /tmp/b2.txt || tail -5 /tmp/b2.txt
echo "== moe_bench, 2 GPUs, capacity 1.25"
mpirun -np 2 --bind-to none -x NCCL_NVLS_ENABLE $B --iters 10 --capacity-factor 1.25 >/tmp/b2c.txt 2>&1; grep -E "$show" /tmp/b2c.txt || tail -5 /tmp/b2c.txt
for args in "" "--capacity-factor 1.25 --pad-to-capacity"; do
  echo "== moe_bench, one GPU $args"
  $B --iters 10 $args >/tmp/b1.txt 2>&1; grep -E "$show" /tmp/b1.txt || tail -5 /tmp/b1.txt
done
T=build/apps/moe_train
C=configs/small-biased.yaml
$T --config $C --layers 1 --steps 200 --log-every 5 >"$OUT/train_bias.txt" 2>&1
$T --config $C --layers 1 --steps 200 --log-every 5 --bias-rate 0 >"$OUT/train_still.txt" 2>&1
tail -3 "$OUT/train_bias.txt" "$OUT/train_still.txt"
python3 bench/plot_balance.py --out "$OUT/expert_bias_balance.png" \
  "bias rate 1e-3=$OUT/train_bias.txt" "no bias update=$OUT/train_still.txt"
tar czf "$OUT/logs.tgz" -C /tmp gpu.log mpi.log b2.txt b2c.txt b1.txt
