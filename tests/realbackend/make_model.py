"""Writes the real-backend suite's model: a 2-layer, 64-wide llama with random weights (fixed seed), the Qwen2
vocabulary from llama.cpp's vocabulary-only GGUF and the Qwen2.5 chat template (which renders tools). Its output is
gibberish; what the suite exercises is the server's real wire, tokenizer, context window and prompt cache.

    python tests/realbackend/make_model.py --tree LLAMA_CPP_TREE --out MODEL.gguf
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

EMBEDDING = 64
LAYERS = 2
HEADS = 4
FEED_FORWARD = 128
# The training window the model claims; the server's -c sets the window a test runs against.
TRAINED_CONTEXT = 32768
SEED = 20261001
# Qwen2.5's chat turn ends with <|im_end|>, so that is the end-of-generation token its template expects.
IM_END = "<|im_end|>"


def _string_array(reader: gguf.GGUFReader, key: str) -> list[str]:
    field = reader.fields[key]
    return [bytes(field.parts[index]).decode("utf-8") for index in field.data]


def _int_array(reader: gguf.GGUFReader, key: str) -> list[int]:
    field = reader.fields[key]
    return [int(field.parts[index][0]) for index in field.data]


def write_model(tree: Path, out: Path) -> None:
    vocab = gguf.GGUFReader(tree / "models" / "ggml-vocab-qwen2.gguf")
    tokens = _string_array(vocab, "tokenizer.ggml.tokens")
    token_types = _int_array(vocab, "tokenizer.ggml.token_type")
    merges = _string_array(vocab, "tokenizer.ggml.merges")
    template = (tree / "models" / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(encoding="utf-8")
    endoftext = int(vocab.fields["tokenizer.ggml.eos_token_id"].contents())

    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("statestore-tiny-qwen2")
    writer.add_context_length(TRAINED_CONTEXT)
    writer.add_embedding_length(EMBEDDING)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FEED_FORWARD)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_rope_dimension_count(EMBEDDING // HEADS)
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(endoftext)
    writer.add_pad_token_id(endoftext)
    writer.add_eos_token_id(tokens.index(IM_END))
    writer.add_add_bos_token(False)
    writer.add_chat_template(template)

    rng = np.random.default_rng(SEED)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    # The two vocabulary-sized matrices are half precision: they are nearly all of the file. The output projection is
    # its own: tied to the embedding, greedy decoding repeats the prompt's last token (a newline) forever, and a reply
    # of whitespace is no text at all (a summary made of it is none).
    writer.add_tensor("token_embd.weight", weight(len(tokens), EMBEDDING).astype(np.float16))
    writer.add_tensor("output.weight", weight(len(tokens), EMBEDDING).astype(np.float16))
    writer.add_tensor("output_norm.weight", np.ones(EMBEDDING, dtype=np.float32))
    for layer in range(LAYERS):
        prefix = f"blk.{layer}"
        writer.add_tensor(f"{prefix}.attn_norm.weight", np.ones(EMBEDDING, dtype=np.float32))
        writer.add_tensor(f"{prefix}.attn_q.weight", weight(EMBEDDING, EMBEDDING))
        writer.add_tensor(f"{prefix}.attn_k.weight", weight(EMBEDDING, EMBEDDING))
        writer.add_tensor(f"{prefix}.attn_v.weight", weight(EMBEDDING, EMBEDDING))
        writer.add_tensor(f"{prefix}.attn_output.weight", weight(EMBEDDING, EMBEDDING))
        writer.add_tensor(f"{prefix}.ffn_norm.weight", np.ones(EMBEDDING, dtype=np.float32))
        writer.add_tensor(f"{prefix}.ffn_gate.weight", weight(FEED_FORWARD, EMBEDDING))
        writer.add_tensor(f"{prefix}.ffn_up.weight", weight(FEED_FORWARD, EMBEDDING))
        writer.add_tensor(f"{prefix}.ffn_down.weight", weight(EMBEDDING, FEED_FORWARD))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tree", type=Path, required=True, help="the llama.cpp source tree")
    parser.add_argument("--out", type=Path, required=True, help="where to write the model")
    args = parser.parse_args()
    write_model(args.tree, args.out)


if __name__ == "__main__":
    main()
