"""``deepspeed.runtime.data_pipeline.data_routing.utils``: the batch-first gather/scatter of a decoder's
kept tokens (per sample, sorted random positions)."""
import torch

__all__ = ["bsh_decoder_gather", "bsh_decoder_scatter"]


def bsh_decoder_gather(reserved_length, hidden_states, mask):
    """Keep ``reserved_length`` random tokens (in order) of each sample of ``[batch, seq, hidden]``:
    returns them, the per-sample kept positions and the mask cut to the kept length."""
    from shardwise.data.random_ltd import gather_tokens, sample_tokens_decoder

    indices, part_mask = sample_tokens_decoder(reserved_length, hidden_states.size(1), hidden_states.size(0), 1,
                                               hidden_states.device, mask)
    _, part = gather_tokens(hidden_states, indices[0], True)
    return part, list(indices[0]), part_mask


def bsh_decoder_scatter(hidden_states, part_hidden_states, rand_list):
    """Write the kept tokens back into ``hidden_states`` (in place) and return it."""
    from shardwise.data.random_ltd import scatter_tokens

    hidden_states.copy_(scatter_tokens(hidden_states, part_hidden_states, torch.stack(list(rand_list)), True))
    return hidden_states
