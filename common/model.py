"""The GPT every chapter trains: GPT-2's architecture, written out as in nanoGPT. Token ids in,
logits out, or a loss when targets are given; it knows nothing about devices, ranks or data."""

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
from torch.nn import functional as F

from .chunked_loss import chunked_cross_entropy

GPT2_VOCAB_SIZE = 50257  # tiktoken's GPT-2 encoding: 50,256 BPE tokens + <|endoftext|>


@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 256  # longest sequence the model can see (learned positions)
    vocab_size: int = 50304  # GPT-2's 50,257 rounded up to a multiple of 64: faster matmuls
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm, as GPT-2 has them
    chunked_loss: bool = True  # without the full logits (chunked_loss.py); False: the plain loss


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32),  # for tests: a step in ms
    "small": GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=128),  # the CPU default
    "gpt2": GPTConfig(block_size=1024, n_layer=12, n_head=12, n_embd=768),  # GPT-2 124M, for GPUs
}


def model_config(preset: str, **overrides) -> GPTConfig:
    """A preset with some fields replaced; `None` means keep the preset's value. The flags offer
    only the presets' names (argparse's choices), so an unknown one is a KeyError."""
    return replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        # one matrix multiplication computes q, k and v at once
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # batch, time, channels (n_embd)
        head_size = C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)  # (B, T, C) each
        # every head attends on its own: (B, T, C) -> (B, n_head, T, head_size)
        q = q.view(B, T, self.n_head, head_size).transpose(1, 2)
        k = k.view(B, T, self.n_head, head_size).transpose(1, 2)
        v = v.view(B, T, self.n_head, head_size).transpose(1, 2)
        # flash attention where the device has it; the causal mask is built in
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # heads side by side again
        y = self.c_proj(y)
        return self.resid_dropout(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.c_fc(x)  # (B, T, 4 * C)
        x = F.gelu(x, approximate="tanh")  # GPT-2's GELU
        x = self.c_proj(x)  # (B, T, C)
        return self.dropout(x)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: normalise, transform, add back to the residual stream."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),  # token embeddings
                wpe=nn.Embedding(config.block_size, config.n_embd),  # learned positions
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Tied embeddings: reading a token in and writing it out use the same matrix.
        self.transformer.wte.weight = self.lm_head.weight
        for module in self.modules():  # GPT-2's init: weights N(0, 0.02), biases 0
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        # GPT-2 scales the projections into the residual stream by 1/sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters counted once (the tied matrix once); positions left out by default."""
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n_params -= self.transformer.wpe.weight.numel()
        return n_params

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(logits, loss) for the token ids idx (B, T).

        Without targets (generating): the last position's logits (B, 1, vocab_size), and no loss.
        With targets (training): the mean cross-entropy loss. The logits (B, T, vocab_size) come
        with it only with chunked_loss off: the chunked loss never builds them, so logits is None.
        """
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(
                f"sequence of length {T} is longer than block_size {self.config.block_size}"
            )
        pos = torch.arange(T, device=idx.device)  # (T,), int64
        tok_emb = self.transformer.wte(idx)  # (B, T, C)
        pos_emb = self.transformer.wpe(pos)  # (T, C)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)  # (B, T, C)
        if targets is None:
            # generating: only the last position's prediction is needed
            logits = self.lm_head(x[:, [-1], :])  # (B, 1, vocab_size)
            loss = None
        elif self.config.chunked_loss:
            # the same loss, a few positions at a time: the (B, T, vocab_size) logits are never held
            logits = None
            loss = chunked_cross_entropy(
                x.view(B * T, -1), self.lm_head.weight, targets.reshape(-1)
            )
        else:
            logits = self.lm_head(x)  # (B, T, vocab_size)
            # the softmax in float32 even under bf16 autocast; float64 stays float64
            loss_dtype = torch.promote_types(logits.dtype, torch.float32)
            loss = F.cross_entropy(logits.view(B * T, -1).to(loss_dtype), targets.reshape(-1))
        return logits, loss

    def optimizer_groups(self, weight_decay: float) -> list[dict]:
        """Weight decay on matrices (weights, embeddings); none on biases and LayerNorm gains."""
        matrices = [p for p in self.parameters() if p.dim() >= 2]
        vectors = [p for p in self.parameters() if p.dim() < 2]
        return [
            {"params": matrices, "weight_decay": weight_decay},
            {"params": vectors, "weight_decay": 0.0},
        ]

    def flops_per_token(self) -> float:
        """Training FLOPs per token (forward + backward), as in the PaLM paper's appendix B."""
        cfg = self.config
        return 6 * self.num_params() + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        top_k: int,
        generator: torch.Generator,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        """Extend idx (B, T) by max_new_tokens tokens, each sampled among the top_k likeliest and
        fed back in."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size :])  # the context the model can see
            logits = logits[:, -1, :GPT2_VOCAB_SIZE].float() / max(temperature, 1e-6)
            kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
            logits[logits < kth] = -float("inf")
            next_id = torch.multinomial(
                F.softmax(logits, dim=-1), num_samples=1, generator=generator
            )
            idx = torch.cat((idx, next_id), dim=1)
        return idx
