"""Run llama.cpp's convert_hf_to_gguf.py, accepting a plain GPT-2 byte-level BPE pre-tokenizer.

The converter recognises BPE pre-tokenizers by hashing how they split a test string, and rejects
any it has no hash for ("BPE pre-tokenizer was not recognized"). A tokenizer trained locally with
`tokenizers`' ByteLevel pre-tokenizer (regex on) splits exactly like llama.cpp's `gpt-2`
pre-tokenizer, so when the hash is unknown and tokenizer.json's pre-tokenizer is that, we answer
"gpt-2". Anything else still fails as before.

    python gguf_convert.py CONVERTER_DIR HF_DIR --outfile OUT.gguf --outtype bf16
"""

import json
import runpy
import sys
from pathlib import Path


def _is_plain_byte_level(model_dir: Path) -> bool:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return False
    pre = json.loads(path.read_text(encoding="utf-8")).get("pre_tokenizer") or {}
    return pre.get("type") == "ByteLevel" and pre.get("use_regex", True)


def main() -> None:
    converter_dir = Path(sys.argv[1])
    sys.path.insert(0, str(converter_dir))
    import conversion.base as base

    original = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            if _is_plain_byte_level(Path(self.dir_model)):
                base.logger.warning("unknown BPE hash, plain ByteLevel pre-tokenizer: using gpt-2")
                return "gpt-2"
            raise

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [str(converter_dir / "convert_hf_to_gguf.py")] + sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
