"""plugserve grammar backend built on xgrammar (the library vLLM and SGLang default to)."""
