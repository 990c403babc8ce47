"""Models, single-device: GPT-2, BERT/RoBERTa, the LRA classifier. Each config builds its model (`config.build()`),
says which attention backend runs it (`attention_backend`) and checks the data it is given (`check_data`)."""

from flashtrain.models.bert import BertConfig, BertForMaskedLM, BertForSequenceClassification, BertModel
from flashtrain.models.gpt2 import GPT2, GPT2Config
from flashtrain.models import hf_convert  # noqa: F401  (importing it registers the GPT-2 and BERT HF adapters)
from flashtrain.models.lra import LRAClassifier, LRAConfig
from flashtrain.models.position import extend_position_embeddings

__all__ = ["BertConfig", "BertForMaskedLM", "BertForSequenceClassification", "BertModel", "GPT2", "GPT2Config",
           "LRAClassifier", "LRAConfig", "extend_position_embeddings"]
