"""A LLaMA-style 1.1B model (TinyLlama's shapes: 22 layers, width 2,048, 32 query and 4
key/value heads, SwiGLU 5,632, 2,048 positions) on one 8-GPU node: ZeRO-3 over 8 data ranks,
bf16 compute, 2M tokens per step. Give data.files a text folder and data.tokenizer a
tokenizer.json of 32,000 tokens. Checked in the tests by planning it on an abstract mesh."""

parallel = dict(mesh={"dp": 8}, zero_stage=3)
model = dict(builder="llama", vocab_size=32000, n_layer=22, n_head=32, n_kv_head=4, n_embd=2048, ffn_hidden=5632,
             block_size=2048)
optim = dict(lr=4e-4, min_lr=4e-5, warmup_steps=2000, decay="cosine", weight_decay=0.1, betas=(0.9, 0.95),
             grad_clip=1.0)
data = dict(source="files", files=["data/corpus"], tokenizer="llama/tokenizer.json", val_fraction=0.005)
train = dict(steps=100_000, global_batch=1024, seq_len=2048, grad_accum=16, param_dtype="bfloat16",
             log_interval=10, eval_interval=1000, eval_steps=20)
checkpoint = dict(dir="runs/llama_1b/ckpt", interval=2000, keep_last=3, resume=True)
