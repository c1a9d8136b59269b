"""Formats: the files tierzero reads and writes for models, beside its own checkpoints.

    safetensors_file.py  a streaming safetensors writer and header reader
    weights.py           weight sources (safetensors files, transformers folders) read per block
    conversions.py       transformers' weight conversions (MoE experts merged, ...) run a block at a time
    load_rules.py        transformers' loading rules: names (peft's too), ignored and missing keys
    buffers.py           buffers and missing parameters: loaded, or computed by the model's initialisation
    checksums.py         the checksum record of a model folder tierzero writes, and its check
    hf_folder.py         transformers' model folder: config files, shards, index, the meta-device build
    corpus.py            training text: the standard library's source, text and JSONL files, batches
    files.py             a model folder's file readable as one (not a FIFO, a device, unreadable)
"""

from tierzero.formats.files import readable_file
from tierzero.formats.checksums import RECORD as CHECKSUM_RECORD, verify_folder
from tierzero.formats.buffers import check_buffers, init_buffers, init_params, load_buffers, persistent_buffers
from tierzero.formats.conversions import original_format_specs
from tierzero.formats.corpus import VOCAB_SIZE, BatchSampler, Tokenizer, file_corpus, stdlib_corpus
from tierzero.formats.hf_folder import (CONFIG_FILE, CONFIG_FILES, INDEX_FILE, SINGLE_FILE,
                                        check_folder_target, folder_tokenizer, kept_names, meta_model,
                                        require_causal_lm, require_transformers, saved_dtype, write_config_files, write_synced,
                                        write_weights_folder)
from tierzero.formats.safetensors_file import (TensorSpec, check_file_target, fsync_dir, save_safetensors,
                                               verify_safetensors, write_safetensors)
from tierzero.formats.load_rules import (PEFT_PREFIX, adapter_params, base_model, checkpoint_name, is_peft,
                                         open_weights, peft_base_name)
from tierzero.formats.weights import LoadedShard, ShardRequest, WeightSource, load_safetensors

__all__ = ["original_format_specs", "VOCAB_SIZE", "BatchSampler", "Tokenizer", "file_corpus", "stdlib_corpus", "CONFIG_FILE", "CONFIG_FILES", "check_folder_target",
           "INDEX_FILE", "SINGLE_FILE", "folder_tokenizer", "kept_names", "meta_model", "require_causal_lm",
           "require_transformers",
           "saved_dtype", "write_config_files", "write_synced", "write_weights_folder", "TensorSpec", "fsync_dir",
           "save_safetensors", "write_safetensors", "check_file_target", "verify_safetensors", "LoadedShard", "ShardRequest", "WeightSource", "check_buffers",
           "init_buffers", "init_params", "load_buffers", "load_safetensors", "open_weights", "persistent_buffers",
           "PEFT_PREFIX", "adapter_params", "base_model", "checkpoint_name", "is_peft", "peft_base_name",
           "CHECKSUM_RECORD", "verify_folder", "readable_file"]
