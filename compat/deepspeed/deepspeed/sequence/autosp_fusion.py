"""``deepspeed.sequence.autosp_fusion``: shardwise's fusion adapters (shardwise.sequence.autosp.fusion) with
DeepSpeed's name for the splice, ``_splice_visual_into_text``. Either name may be overridden in a subclass:
the adapter's forward calls DeepSpeed's name when a subclass defines it, else shardwise's ``splice``."""
from shardwise.sequence.autosp import fusion as _fusion

_DEFAULT_IMAGE_TOKEN_ID = _fusion.LLAVA_IMAGE_TOKEN_ID


class _DeepSpeedSplice:
    def splice(self, text_embeds, visual_embeds, input_ids):
        if type(self)._splice_visual_into_text is not _DeepSpeedSplice._splice_visual_into_text:
            return self._splice_visual_into_text(text_embeds, visual_embeds, input_ids)
        return super().splice(text_embeds, visual_embeds, input_ids)

    def _splice_visual_into_text(self, text_embeds, visual_embeds, input_ids):
        if type(self).splice is not _DeepSpeedSplice.splice:
            return self.splice(text_embeds, visual_embeds, input_ids)
        return super().splice(text_embeds, visual_embeds, input_ids)


class ModalityFusionSPAdapter(_DeepSpeedSplice, _fusion.ModalityFusionSPAdapter):
    pass


class LlavaFusionAdapter(_DeepSpeedSplice, _fusion.LlavaFusionAdapter):
    pass


class InternVLFusionAdapter(_DeepSpeedSplice, _fusion.InternVLFusionAdapter):
    pass


class Qwen2VLFusionAdapter(_DeepSpeedSplice, _fusion.Qwen2VLFusionAdapter):
    pass
