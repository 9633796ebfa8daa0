#!/usr/bin/env bash
# Seed fuzz/corpus/gguf_parse: the first 1 MiB of the default model, the R1
# header-only fixture, and a tiny complete llama GGUF (F32 weights, gpt2
# tokenizer) so the config/weights/tokenizer paths are reached quickly.
set -euo pipefail
cd "$(dirname "$0")"
out=corpus/gguf_parse
mkdir -p "$out"
head -c 1048576 ../models/SmolLM2-135M-Instruct.Q4_1.gguf > "$out/smollm2-head-1m.gguf"
cat ../../shared/data/r1-distill-qwen-7b.header.gguf > "$out/r1-header.gguf"
python3 - "$out/tiny-llama.gguf" <<'PY'
import struct, sys
A = 32
def s(x): b = x.encode(); return struct.pack('<Q', len(b)) + b
kv = []
def put(k, t, payload): kv.append(s(k) + struct.pack('<I', t) + payload)
put('general.architecture', 8, s('llama'))
for k, v in [('block_count', 1), ('context_length', 64), ('embedding_length', 32),
             ('feed_forward_length', 64), ('attention.head_count', 2), ('attention.head_count_kv', 1)]:
    put('llama.' + k, 4, struct.pack('<I', v))
put('llama.attention.layer_norm_rms_epsilon', 6, struct.pack('<f', 1e-5))
toks = [chr(c) for c in range(33, 127)] + ['Ġ', 'he', 'll', '<|endoftext|>', '<|im_start|>']
types = [1] * (len(toks) - 2) + [3, 3]
put('tokenizer.ggml.model', 8, s('gpt2'))
put('tokenizer.ggml.pre', 8, s('smollm'))
put('tokenizer.ggml.tokens', 9, struct.pack('<IQ', 8, len(toks)) + b''.join(s(t) for t in toks))
put('tokenizer.ggml.token_type', 9, struct.pack('<IQ', 5, len(types)) + b''.join(struct.pack('<i', t) for t in types))
merges = ['h e', 'l l']
put('tokenizer.ggml.merges', 9, struct.pack('<IQ', 8, len(merges)) + b''.join(s(m) for m in merges))
put('tokenizer.ggml.bos_token_id', 4, struct.pack('<I', len(toks) - 2))
put('tokenizer.ggml.eos_token_id', 4, struct.pack('<I', len(toks) - 2))
D, F, KV, V = 32, 64, 16, len(toks)
tensors = [('token_embd.weight', [D, V]), ('output_norm.weight', [D]), ('blk.0.attn_norm.weight', [D]),
           ('blk.0.attn_q.weight', [D, D]), ('blk.0.attn_k.weight', [D, KV]), ('blk.0.attn_v.weight', [D, KV]),
           ('blk.0.attn_output.weight', [D, D]), ('blk.0.ffn_norm.weight', [D]),
           ('blk.0.ffn_gate.weight', [D, F]), ('blk.0.ffn_up.weight', [D, F]), ('blk.0.ffn_down.weight', [F, D])]
hdr = b'GGUF' + struct.pack('<IQQ', 3, len(tensors), len(kv)) + b''.join(kv)
data = b''
for name, dims in tensors:
    n = 1
    for d in dims: n *= d
    hdr += s(name) + struct.pack('<I', len(dims)) + b''.join(struct.pack('<Q', d) for d in dims)
    hdr += struct.pack('<IQ', 0, len(data))
    data += b''.join(struct.pack('<f', ((i % 7) - 3) * 0.01) for i in range(n))
    data += b'\0' * (-len(data) % A)
hdr += b'\0' * (-len(hdr) % A)
open(sys.argv[1], 'wb').write(hdr + data)
PY
ls -l "$out"
