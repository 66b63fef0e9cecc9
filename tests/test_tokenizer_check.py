"""The tokenizer check refuses a tokenizer that splits words its vocabulary holds whole
(the GGUF conversion bug of some transformers versions) and accepts the real one."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from oscarkv.errors import TokenizerError
from oscarkv.models import PROBE_SENTENCE, check_tokenizer, split_vocabulary_words


def sentencepiece_style(with_merges: bool) -> PreTrainedTokenizerFast:
    """A BPE tokenizer whose vocabulary holds every probe word as "▁word"; without merges it
    encodes them letter by letter, as transformers 5.17 did with Gemma 3's GGUF."""
    words = ["\u2581" + w for w in PROBE_SENTENCE.rstrip(".").split()]
    letters = sorted(set("".join(words)) | {"."})
    vocab = {token: i for i, token in enumerate(dict.fromkeys(["<unk>", *letters, *words]))}
    merges = []
    if with_merges:
        for word in dict.fromkeys(words):
            for end in range(2, len(word) + 1):
                left, right = word[: end - 1], word[end - 1]
                merges.append((left, right))
                vocab.setdefault(left + right, len(vocab))
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    bpe.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>")


def test_tokenizer_without_merges_is_refused_with_the_fix():
    broken = sentencepiece_style(with_merges=False)
    whole, split = split_vocabulary_words(broken)
    assert len(whole) >= 10 and split == whole
    with pytest.raises(TokenizerError, match=r"upgrade transformers .*delete the converted copy"):
        check_tokenizer(broken, "toy.gguf")


def test_tokenizer_with_merges_passes():
    whole, split = split_vocabulary_words(sentencepiece_style(with_merges=True))
    assert len(whole) >= 10 and split == []
    check_tokenizer(sentencepiece_style(with_merges=True), "toy.gguf")


def test_embedded_model_tokenizer_passes():
    from transformers import AutoTokenizer

    from oscarkv.models import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m")))
    whole, split = split_vocabulary_words(tokenizer)
    assert len(whole) >= 10 and split == []


def test_a_conversion_gives_the_gguf_eos_and_pad_tokens():
    """transformers 5.17 converts SmolLM2's GGUF with <|im_start|> as EOS and no pad token (later releases read
    tokenizer.ggml.eos_token_id and padding_token_id), and such a tokenizer cannot pad a batch; the conversion
    sets the tokens the GGUF declares (`set_gguf_special_tokens`), and leaves a pad token that is there alone."""
    from transformers import AutoTokenizer

    from oscarkv.assets import SMOLLM2_GGUF, asset_path
    from oscarkv.models import resolve_model, set_gguf_special_tokens

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m")))
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|im_end|>")  # the converted directory's
    tokenizer.eos_token, tokenizer.pad_token = "<|im_start|>", None  # as transformers 5.17 converts it
    with pytest.raises(ValueError, match="padding token"):
        tokenizer(["a", "a b c"], padding=True)
    set_gguf_special_tokens(tokenizer, asset_path(SMOLLM2_GGUF))
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (2, 2)
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|im_end|>")
    rows = tokenizer(["a", "a b c"], padding=True)["input_ids"]
    assert len(rows[0]) == len(rows[1]) and 2 in rows[0]
    tokenizer.pad_token = "<|im_start|>"
    set_gguf_special_tokens(tokenizer, asset_path(SMOLLM2_GGUF))
    assert tokenizer.pad_token == "<|im_start|>"
