"""The grammar-backend conformance suite (`plugserve conformance --grammar NAME`): the backend
alone on the tiny model's byte-level vocabulary (`kernel`), then in an engine (`engine`)."""
