"""A LLaMA-style 7B model (LLaMA-2-7B's shapes: 32 layers, width 4,096, 32 heads, SwiGLU 11,008,
4,096 positions) on 64 GPUs (8 nodes of 8): 2 pipeline stages (1F1B, 8 microbatches) x 4 data
ranks x 8-way tensor parallel inside a node with sequence parallelism, ZeRO-1, selective
activation checkpointing, bf16 compute, 4M tokens per step. Give data.files a text folder and
data.tokenizer a tokenizer.json of 32,000 tokens. Checked in the tests by planning it on an
abstract mesh."""

parallel = dict(mesh={"pp": 2, "dp": 4, "tp": 8}, zero_stage=1, sequence_parallel=True, schedule="1f1b",
                microbatches=8, activation_checkpointing="selective")
model = dict(builder="llama", vocab_size=32000, n_layer=32, n_head=32, n_kv_head=32, n_embd=4096, ffn_hidden=11008,
             block_size=4096)
optim = dict(lr=3e-4, min_lr=3e-5, warmup_steps=2000, decay="cosine", weight_decay=0.1, betas=(0.9, 0.95),
             grad_clip=1.0)
data = dict(source="files", files=["data/corpus"], tokenizer="llama/tokenizer.json", val_fraction=0.005)
train = dict(steps=500_000, global_batch=1024, seq_len=4096, param_dtype="bfloat16", log_interval=10,
             eval_interval=1000, eval_steps=20)
checkpoint = dict(dir="runs/llama_7b/ckpt", interval=1000, keep_last=3, resume=True)
