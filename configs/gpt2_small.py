"""GPT-2 small (124M) on a GPU node: 8 data ranks, ZeRO-1, bf16 compute, nanoGPT's recipe
(0.5M tokens per step: 480 sequences of 1,024 tokens over 8 ranks x 4 accumulation steps; lr 6e-4
with 2,000 warmup steps and cosine decay to 6e-5). Give data.files a text folder and
data.tokenizer the GPT-2 tokenizer.json (vocabulary 50,257, padded to 50,304 in the model).
Checked in the tests by planning it on an abstract mesh, not by training."""

parallel = dict(mesh={"dp": 8}, zero_stage=1)
model = dict(builder="gpt", vocab_size=50304, n_layer=12, n_head=12, n_embd=768, block_size=1024, dropout=0.0)
optim = dict(lr=6e-4, min_lr=6e-5, warmup_steps=2000, decay="cosine", weight_decay=0.1, betas=(0.9, 0.95),
             grad_clip=1.0)
data = dict(source="files", files=["data/openwebtext"], tokenizer="gpt2/tokenizer.json", val_fraction=0.005)
train = dict(steps=600_000, global_batch=480, seq_len=1024, grad_accum=4, param_dtype="bfloat16", log_interval=10,
             eval_interval=2000, eval_steps=20)
checkpoint = dict(dir="runs/gpt2_small/ckpt", interval=5000, keep_last=3, resume=True)
