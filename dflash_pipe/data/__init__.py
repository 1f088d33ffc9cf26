"""Input data for stage 1 (conversations -> token ids + loss masks) and prompt sets for eval.

`sources` reads and validates rows, `tokenize` renders them with the chat template and builds
loss masks, `prompts` loads MT-Bench / HumanEval / held-out prompts. See each module's docstring.
"""

from .prompts import PROMPT_SETS, Prompt, load_prompt_sets, load_prompts
from .sources import (EMBEDDED_SHAREGPT, Conversation, dataset_fingerprint, dataset_identity, iter_conversations,
                      load_conversations, resolve_source, select)
from .stats import REASONS, DataStats
from .tokenize import (ConversationTokenizer, TokenizedSample, chat_template_hash, iter_shard, iter_tokenized,
                       shard_of, tokenize_conversation)

__all__ = [
    "EMBEDDED_SHAREGPT", "PROMPT_SETS", "REASONS", "Conversation", "ConversationTokenizer", "DataStats", "Prompt",
    "TokenizedSample", "chat_template_hash", "dataset_fingerprint", "dataset_identity", "iter_conversations",
    "iter_shard", "iter_tokenized", "load_conversations", "load_prompt_sets", "load_prompts", "resolve_source",
    "select", "shard_of", "tokenize_conversation",
]
