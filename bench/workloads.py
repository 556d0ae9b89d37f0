"""Training and inference workloads of public model shapes with random weights (nothing is
downloaded). Each builder returns a `step(rng)` function that runs one training step (or one
generate() call) on the GPU; lengths and batch sizes come from `rng`, so two runs with the same
seed see the same sequence of shapes.

  opt-lora   workload A: OPT-1.3B shape, LoRA r=8 on q_proj/v_proj, activation checkpointing,
             batch 32, sequence length 64..1024
  llama-ft   workload B: Llama-1B shape (22 layers, 4 KV heads), full fine-tune, batch 16,
             sequence length 64..2048
  moe        Mixtral-shaped mixture of experts, full fine-tune, batch 8, length 128..1024
  generate   Llama-shaped model, generate() with a KV cache, batch 4..32, prompt 64..768,
             32..256 new tokens
  mix        OPT-350M shape, full fine-tune, batch 24, length 32..2048
  vision     ResNet-50-shaped convolutional network (plain PyTorch), full training in bf16,
             image side 96..384 in steps of 32 and batch 8..96 changing every step: new
             activation shapes all run long
  lora-vocab Llama-shaped (16 layers, 128256-token vocabulary), LoRA r=16 on every linear
             layer, batch 8, length 64..2048: logits and their gradients of 0.1-4 GiB of
             changing size next to many small adapter tensors
"""

import torch


def build(cls, config):
    """The model in bf16 on the GPU, built there directly."""
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = cls(config)
    torch.set_default_dtype(torch.float32)
    return model


def train(model, loss_of, lr=1e-5):
    """One step of AdamW on the loss `loss_of(rng)` gives."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()

    def step(rng):
        loss_of(rng).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def training_step(model, vocab, batch, lengths):
    """Next-token loss with sequence lengths drawn from `lengths`."""

    def loss_of(rng):
        seq = rng.randint(*lengths)
        ids = torch.randint(0, vocab, (batch, seq), device="cuda")
        return model(input_ids=ids, labels=ids).loss

    return train(model, loss_of)


def opt_lora():
    from peft import LoraConfig, get_peft_model
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(hidden_size=2048, ffn_dim=8192, num_hidden_layers=24,
                       num_attention_heads=32, word_embed_proj_dim=2048, vocab_size=50272,
                       max_position_embeddings=2048)
    model = build(OPTForCausalLM, config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                      task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    return training_step(model, config.vocab_size, 32, (64, 1024))


def llama_ft():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                         num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                         max_position_embeddings=4096)
    model = build(LlamaForCausalLM, config)
    return training_step(model, config.vocab_size, 16, (64, 2048))


def moe():
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                           num_attention_heads=16, num_key_value_heads=4, num_local_experts=8,
                           num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=4096)
    model = build(MixtralForCausalLM, config)
    return training_step(model, config.vocab_size, 8, (128, 1024))


def generate():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                         max_position_embeddings=4096)
    model = build(LlamaForCausalLM, config).eval()

    def step(rng):
        batch = rng.choice([4, 8, 16, 32])
        prompt = rng.randint(64, 768)
        new = rng.randint(32, 256)
        ids = torch.randint(0, config.vocab_size, (batch, prompt), device="cuda")
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                           max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=0)

    return step


def mix():
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(hidden_size=1024, ffn_dim=4096, num_hidden_layers=24,
                       num_attention_heads=16, word_embed_proj_dim=1024, vocab_size=50272,
                       max_position_embeddings=2048)
    model = build(OPTForCausalLM, config)
    return training_step(model, config.vocab_size, 24, (32, 2048))


def _resnet50(classes=1000):
    """ResNet-50's layout (bottleneck blocks 3-4-6-3, widths 256..2048), without torchvision."""
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, cin, width, stride):
            super().__init__()
            cout = width * 4
            self.body = nn.Sequential(
                nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width),
                nn.ReLU(), nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
            self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                       nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

        def forward(self, x):
            return torch.relu(self.body(x) + self.skip(x))

    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
              nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for width, blocks, stride in [(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)]:
        for i in range(blocks):
            layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
            cin = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def vision():
    model = build(lambda _: _resnet50(), None)

    def loss_of(rng):
        side = rng.choice(range(96, 385, 32))
        batch = rng.choice([8, 16, 24, 32, 48, 64, 96])
        images = torch.randn(batch, 3, side, side, device="cuda", dtype=torch.bfloat16)
        labels = torch.randint(0, 1000, (batch,), device="cuda")
        return torch.nn.functional.cross_entropy(model(images).float(), labels)

    return train(model, loss_of, lr=1e-4)


def lora_vocab():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=4096)
    model = build(LlamaForCausalLM, config)
    lora = LoraConfig(r=16, lora_alpha=32, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                      "up_proj", "down_proj"])
    model = get_peft_model(model, lora)
    return training_step(model, config.vocab_size, 8, (64, 2048))


WORKLOADS = {
    "opt-lora": opt_lora,
    "llama-ft": llama_ft,
    "moe": moe,
    "generate": generate,
    "mix": mix,
    "vision": vision,
    "lora-vocab": lora_vocab,
}
