"""GPT-2 medium (350M) on a GPU node: 4 data ranks x 2-way Megatron tensor parallel with
sequence parallelism, ZeRO-1, bf16 compute, 0.5M tokens per step. Give data.files a text folder
and data.tokenizer the GPT-2 tokenizer.json. Checked in the tests by planning it on an abstract
mesh, not by training."""

parallel = dict(mesh={"dp": 4, "tp": 2}, zero_stage=1, sequence_parallel=True)
model = dict(builder="gpt", vocab_size=50304, n_layer=24, n_head=16, n_embd=1024, block_size=1024, dropout=0.0)
optim = dict(lr=3e-4, min_lr=3e-5, warmup_steps=2000, decay="cosine", weight_decay=0.1, betas=(0.9, 0.95),
             grad_clip=1.0)
data = dict(source="files", files=["data/openwebtext"], tokenizer="gpt2/tokenizer.json", val_fraction=0.005)
train = dict(steps=400_000, global_batch=480, seq_len=1024, grad_accum=8, param_dtype="bfloat16", log_interval=10,
             eval_interval=2000, eval_steps=20)
checkpoint = dict(dir="runs/gpt2_medium/ckpt", interval=5000, keep_last=3, resume=True)
