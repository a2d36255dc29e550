"""A BERT-style transformer encoder layer with DeepSpeed's fused-layer config, parameters and math,
in plain PyTorch (DeepSpeed's ``DeepSpeedTransformerLayer`` runs the same computation as CUDA kernels).

With ``x`` the input ``[batch, seq, hidden]``, ``mask`` an additive attention mask broadcastable to
``[batch, heads, seq, seq]`` (DeepSpeed's convention: ``[batch, 1, 1, seq]`` holding 0 for tokens to
attend to and a large negative number, e.g. -10000, for padding), ``LN`` layer norm with
``layer_norm_eps``, ``gelu`` the tanh approximation, ``drop_a``/``drop_h`` dropout with
``attn_dropout_ratio``/``hidden_dropout_ratio`` (training only), ``d = hidden / heads``:

    attention(y) = merge_heads(drop_a(softmax(q k^T / sqrt(d) + mask)) v),
                   q, k, v = split_heads(y attn_qkvw^T + attn_qkvb)

pre-LN (``pre_layer_norm=True``):

    a   = x + drop_h(attention(LN(x; norm_w, norm_b)) attn_ow^T + attn_ob)
    out = a + drop_h(gelu(LN(a; attn_nw, attn_nb) inter_w^T + inter_b) output_w^T + output_b)

post-LN (``pre_layer_norm=False``):

    a   = LN(x + drop_h(attention(x) attn_ow^T + attn_ob); attn_nw, attn_nb)
    out = LN(a + drop_h(gelu(a inter_w^T + inter_b) output_w^T + output_b); norm_w, norm_b)

The memory options of the kernels (``normalize_invertible``, ``gelu_checkpoint``,
``attn_dropout_checkpoint``, ``stochastic_mode``) change nothing here; dropout draws from torch's
generator (seed it with ``torch.manual_seed``; ``seed`` is kept for the config's sake); the layer
computes in its parameters' dtype (``fp16`` is kept for the config's sake: call ``.half()``).
"""

from __future__ import annotations

import json
import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TransformerLayerConfig", "TransformerLayer"]

logger = logging.getLogger("shardwise")


class TransformerLayerConfig:
    """DeepSpeed's ``DeepSpeedTransformerConfig`` fields and defaults (``intermediate_size`` <= 0 means
    ``4 * hidden_size``)."""

    def __init__(self, batch_size=-1, hidden_size=-1, intermediate_size=-1, heads=-1, attn_dropout_ratio=-1,
                 hidden_dropout_ratio=-1, num_hidden_layers=-1, initializer_range=-1, layer_norm_eps=1e-12,
                 local_rank=-1, seed=-1, fp16=False, pre_layer_norm=True, normalize_invertible=False,
                 gelu_checkpoint=False, adjust_init_range=True, attn_dropout_checkpoint=False, stochastic_mode=False,
                 return_tuple=False, training=True) -> None:
        self.layer_id = -1
        self.batch_size = batch_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size if intermediate_size > 0 else 4 * hidden_size
        self.heads = heads
        self.attn_dropout_ratio = attn_dropout_ratio
        self.hidden_dropout_ratio = hidden_dropout_ratio
        self.num_hidden_layers = num_hidden_layers
        self.initializer_range = initializer_range
        self.fp16 = fp16
        self.pre_layer_norm = pre_layer_norm
        self.local_rank = local_rank
        self.seed = seed
        self.normalize_invertible = normalize_invertible
        self.gelu_checkpoint = gelu_checkpoint
        self.adjust_init_range = adjust_init_range
        self.test_gemm = False
        self.layer_norm_eps = layer_norm_eps
        self.training = training
        self.is_grad_enabled = True
        self.attn_dropout_checkpoint = attn_dropout_checkpoint
        self.stochastic_mode = stochastic_mode
        self.return_tuple = return_tuple

    @classmethod
    def from_dict(cls, json_object: dict):
        config = cls()
        for key, value in json_object.items():
            config.__dict__[key] = value
        return config

    @classmethod
    def from_json_file(cls, json_file):
        """DeepSpeed reads these files as UTF-16; a UTF-8 file is read too."""
        raw = open(json_file, "rb").read()
        text = raw.decode("utf-16") if raw[:2] in (b"\xff\xfe", b"\xfe\xff") else raw.decode("utf-8")
        return cls.from_dict(json.loads(text))


class TransformerLayer(nn.Module):
    """DeepSpeed's fused transformer layer (see the module docstring for the math). Parameters, in
    DeepSpeed's names and shapes: ``attn_qkvw [3h, h]``, ``attn_qkvb [3h]``, ``attn_ow [h, h]``,
    ``attn_ob``, ``attn_nw``, ``attn_nb``, ``inter_w [i, h]``, ``inter_b [i]``, ``output_w [h, i]``,
    ``output_b``, ``norm_w``, ``norm_b``. Each instance takes the next ``layer_id`` (a class counter)."""

    layer_id = 0

    def __init__(self, config: TransformerLayerConfig, initial_weights=None, initial_biases=None) -> None:
        super().__init__()
        self.config = config
        config.layer_id = TransformerLayer.layer_id
        TransformerLayer.layer_id += 1
        h, i = config.hidden_size, config.intermediate_size
        if h <= 0 or config.heads <= 0 or h % config.heads:
            raise ValueError(f"transformer layer: hidden_size ({h}) must be a positive multiple of heads "
                             f"({config.heads})")
        logger.debug("transformer layer %d config: %s", config.layer_id, config.__dict__)
        if config.local_rank >= 0 and torch.cuda.is_available():
            torch.cuda.set_device(config.local_rank)
        if initial_weights is None and initial_biases is None:
            shapes = (("attn_qkvw", (3 * h, h)), ("attn_qkvb", (3 * h,)), ("attn_ow", (h, h)), ("attn_ob", (h,)),
                      ("attn_nw", (h,)), ("attn_nb", (h,)), ("inter_w", (i, h)), ("inter_b", (i,)),
                      ("output_w", (h, i)), ("output_b", (h,)), ("norm_w", (h,)), ("norm_b", (h,)))
            for name, shape in shapes:
                setattr(self, name, nn.Parameter(torch.empty(shape)))
            self.init_transformer_weights(config.adjust_init_range)
        else:  # DeepSpeed's test path: [q, k, v, attn_ow, attn_nw, inter_w, output_w, norm_w] and biases
            if initial_weights is not None:
                q, k, v = (w.data for w in initial_weights[:3])
                self.attn_qkvw = nn.Parameter(torch.cat((q, k, v)))
                self.attn_qkvb = nn.Parameter(torch.zeros(3 * h, dtype=q.dtype, device=q.device))
                (self.attn_ow, self.attn_nw, self.inter_w, self.output_w, self.norm_w) = initial_weights[3:8]
            if initial_biases is not None:
                (self.attn_ob, self.attn_nb, self.inter_b, self.output_b, self.norm_b) = initial_biases[3:8]

    def init_transformer_weights(self, adjust_init_range: bool = False) -> None:
        """Normal(0, initializer_range) weights, zero biases, unit norms; the two output projections get
        ``initializer_range / sqrt(2 * num_hidden_layers)`` when ``adjust_init_range`` and ``local_rank`` is
        0 (DeepSpeed's condition)."""
        c = self.config
        output_std = c.initializer_range
        if adjust_init_range and c.local_rank == 0:
            output_std = c.initializer_range / math.sqrt(2.0 * c.num_hidden_layers)
        with torch.no_grad():
            self.attn_qkvw.normal_(mean=0.0, std=c.initializer_range)
            self.attn_qkvb.zero_()
            self.attn_ow.normal_(mean=0.0, std=output_std)
            self.attn_ob.zero_()
            self.attn_nw.fill_(1.0)
            self.attn_nb.zero_()
            self.inter_w.normal_(mean=0.0, std=c.initializer_range)
            self.inter_b.zero_()
            self.output_w.normal_(mean=0.0, std=output_std)
            self.output_b.zero_()
            self.norm_w.fill_(1.0)
            self.norm_b.zero_()

    def _dropout(self, x: torch.Tensor, ratio: float) -> torch.Tensor:
        return F.dropout(x, p=ratio, training=True) if self.training and ratio > 0 else x

    def _layer_norm(self, x, weight, bias):
        return F.layer_norm(x, (x.shape[-1],), weight, bias, self.config.layer_norm_eps)

    def _attention(self, y: torch.Tensor, mask) -> torch.Tensor:
        c = self.config
        b, s, h = y.shape
        d = h // c.heads
        qkv = F.linear(y, self.attn_qkvw, self.attn_qkvb)
        q, k, v = (t.view(b, s, c.heads, d).transpose(1, 2) for t in qkv.split(h, dim=-1))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d)
        if mask is not None:
            scores = scores + mask.to(scores.dtype)
        probs = self._dropout(torch.softmax(scores, dim=-1), c.attn_dropout_ratio)
        return torch.matmul(probs, v).transpose(1, 2).reshape(b, s, h)

    def forward(self, hidden_states, attention_mask=None, head_mask=None, layer_head_mask=None,
                encoder_hidden_states=None, encoder_attention_mask=None, past_key_value=None,
                output_attentions=False, grads=None):
        """``hidden_states [batch, seq, hidden]`` -> the same shape (``(out,)`` with ``return_tuple``). The
        Hugging Face arguments after ``attention_mask`` are accepted and not used, as in DeepSpeed."""
        c = self.config
        c.is_grad_enabled, c.training = torch.is_grad_enabled(), self.training
        if grads is not None:
            self._record_grads(grads)
        x, p = hidden_states, c.hidden_dropout_ratio
        if c.pre_layer_norm:
            attn = self._attention(self._layer_norm(x, self.norm_w, self.norm_b), attention_mask)
            a = x + self._dropout(F.linear(attn, self.attn_ow, self.attn_ob), p)
            ff = F.gelu(F.linear(self._layer_norm(a, self.attn_nw, self.attn_nb), self.inter_w, self.inter_b),
                        approximate="tanh")
            out = a + self._dropout(F.linear(ff, self.output_w, self.output_b), p)
        else:
            attn = self._attention(x, attention_mask)
            a = self._layer_norm(x + self._dropout(F.linear(attn, self.attn_ow, self.attn_ob), p), self.attn_nw,
                                 self.attn_nb)
            ff = F.gelu(F.linear(a, self.inter_w, self.inter_b), approximate="tanh")
            out = self._layer_norm(a + self._dropout(F.linear(ff, self.output_w, self.output_b), p), self.norm_w,
                                   self.norm_b)
        return (out,) if c.return_tuple else out

    def _record_grads(self, grads: list) -> None:
        """DeepSpeed's test hook: append ``[grad, name]`` as each gradient is computed (V part of the QKV)."""
        h = self.attn_ow.shape[0]
        if self.attn_qkvw.requires_grad:
            self.attn_qkvw.register_hook(lambda g: grads.append([g[2 * h:3 * h], "V_W"]))
            self.attn_qkvb.register_hook(lambda g: grads.append([g[2 * h:3 * h], "V_B"]))
        for name, tag in (("attn_ow", "O_W"), ("attn_ob", "O_B"), ("attn_nw", "N2_W"), ("attn_nb", "N2_B"),
                          ("inter_w", "int_W"), ("inter_b", "int_B"), ("output_w", "out_W"),
                          ("output_b", "out_B"), ("norm_w", "norm_W"), ("norm_b", "norm_B")):
            param = getattr(self, name)
            if param.requires_grad:
                param.register_hook(lambda g, tag=tag: grads.append([g, tag]))
