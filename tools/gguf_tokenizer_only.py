#!/usr/bin/env python3
"""A GGUF holding only another GGUF's gpt2-style tokenizer (its tokenizer.* keys, no tensors): what
tools/gen_qwen2_gguf.py --tokenizer-from reads, small enough to carry to a device run.

    python3 tools/gguf_tokenizer_only.py SmolLM2.gguf smol-tokenizer.gguf
"""
import sys

import gguf


def main():
    src, dst = sys.argv[1], sys.argv[2]
    r = gguf.GGUFReader(src)

    def field(name):
        return r.fields[name].contents()

    w = gguf.GGUFWriter(dst, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(field("tokenizer.ggml.pre"))
    w.add_token_list(field("tokenizer.ggml.tokens"))
    w.add_token_types(field("tokenizer.ggml.token_type"))
    w.add_token_merges(field("tokenizer.ggml.merges"))
    w.add_bos_token_id(field("tokenizer.ggml.bos_token_id"))
    w.add_eos_token_id(field("tokenizer.ggml.eos_token_id"))
    w.add_chat_template(field("tokenizer.chat_template"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
