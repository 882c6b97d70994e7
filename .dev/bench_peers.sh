#!/bin/bash
# Side by side: snug bench and torch_gpt.py, in sequence, on this host. Usage: bench_peers.sh OUTDIR [rounds] [gpt2]
set -u
OUT=${1:-/work/main/.dev/peers}; ROUNDS=${2:-2}; GPT2=${3:-yes}
mkdir -p $OUT
SNUG=/work/main/target/release/snug
PY=~/.venv-peers/bin/python
T=/work/shared/peers/torch_gpt.py
A="--n-layer 6 --n-head 6 --n-embd 384 --block 256 --batch 16 --vocab 65"
D="--n-layer 12 --n-head 12 --n-embd 768 --block 1024 --batch 4 --vocab 50304"
cd /work/main
for r in $(seq 1 $ROUNDS); do
  /usr/bin/time -v $SNUG bench --json --cases char-small,char-small-bf16 --steps 10 --warmup 2 > $OUT/snug_r$r.json 2> $OUT/snug_r$r.time
  /usr/bin/time -v $PY $T --threads 2 $A --warmup 3 --steps 10 > $OUT/torch_f32_r$r.txt 2> $OUT/torch_f32_r$r.time
  /usr/bin/time -v $PY $T --threads 2 $A --warmup 3 --steps 10 --bf16 > $OUT/torch_bf16_r$r.txt 2> $OUT/torch_bf16_r$r.time
done
if [ "$GPT2" = yes ]; then
  /usr/bin/time -v $SNUG bench --json --cases gpt2,gpt2-bf16 --steps 3 --warmup 2 > $OUT/snug_gpt2.json 2> $OUT/snug_gpt2.time
  /usr/bin/time -v $PY $T --threads 2 $D --warmup 2 --steps 3 > $OUT/torch_gpt2_f32.txt 2> $OUT/torch_gpt2_f32.time
  /usr/bin/time -v $PY $T --threads 2 $D --warmup 2 --steps 3 --bf16 > $OUT/torch_gpt2_bf16.txt 2> $OUT/torch_gpt2_bf16.time
fi
echo finished > $OUT/DONE
