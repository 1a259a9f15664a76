"""Shakespeare: a 10.8M-parameter GPT on the 42 plays (a folder of plain-text files; point
data.files at yours), a byte-level BPE of 4,096 tokens learned on the training plays, held-out
plays for validation; ZeRO-1 over every rank. On 2 CPU cores about 10 minutes; set
train.steps for longer. The tokenizer and the memory-mapped token files are made on the first
run and cached (data.cache_dir)."""

parallel = dict(mesh={"dp": -1}, zero_stage=1)
model = dict(builder="gpt", vocab_size=4096, n_layer=6, n_head=6, n_embd=384, block_size=256, dropout=0.0)
optim = dict(lr=1e-3, min_lr=1e-4, warmup_steps=50, decay="cosine", weight_decay=0.1, grad_clip=1.0)
data = dict(source="files", files=["shakespeare"], tokenizer="bpe", vocab_size=4096,
            val_files=["hamlet.txt", "tempest.txt", "twelfth_night.txt"])
train = dict(steps=600, global_batch=16, seq_len=256, log_interval=25, eval_interval=200, eval_steps=8)
checkpoint = dict(dir=None)
