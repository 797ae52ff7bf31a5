"""Pretrained models on multihead attention: a BERT-family encoder (all-MiniLM-L6-v2 embedded),
GPT-2/Llama/Mistral/Qwen2 decoders and the BART encoder-decoder on ``transformers`` with our
attention.

Example:
    >>> from multihead.models import load
    >>> model = load()                       # the embedded all-MiniLM-L6-v2, offline
    >>> model.embed(["attention is all you need"]).shape
    torch.Size([1, 384])
"""

from .bert import BertConfig, BertEncoder, EncoderOutput, UnsupportedModel
from .hf_models import (DECODER_TYPES, ENCODER_DECODER_TYPES, HF_TYPES, Decoder, EncoderDecoder,
                        HFConfig, HFModel)
from .loading import ModelLoadError, default_model_dir, expected_tensors, load
from .pretrained import Pretrained, Tokens

__all__ = ["BertConfig", "BertEncoder", "EncoderOutput", "UnsupportedModel", "ModelLoadError",
           "default_model_dir", "expected_tensors", "load", "Pretrained", "Tokens",
           "DECODER_TYPES", "ENCODER_DECODER_TYPES", "HF_TYPES", "Decoder", "EncoderDecoder",
           "HFConfig", "HFModel"]
