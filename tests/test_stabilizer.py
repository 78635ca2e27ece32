"""LocalAgreement-2 commit rules."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.stabilizer import LocalAgreement, joined, keys


def test_commits_what_two_hypotheses_agree_on() -> None:
    la = LocalAgreement()
    assert la.update("the quick") == ("the quick", "")  # one hypothesis commits nothing
    assert la.update("the quick brown") == ("the quick brown", "the quick")
    assert la.update("the quick brown fax") == ("the quick brown fax", "the quick brown")
    assert la.update("the quick brown fox jumps") == ("the quick brown fox jumps", "the quick brown")
    assert la.update("the quick brown fox jumped over") == ("the quick brown fox jumped over", "the quick brown fox")
    assert la.committed == "the quick brown fox"
    assert la.finalize("the quick brown fox jumped over the dog.") == ("the quick brown fox jumped over the dog.", False)


def test_the_last_word_heard_is_never_committed() -> None:
    """Audio is cut at the partial's end, often mid-word ("ill" of "ill-disposed"): even when two
    hypotheses end with the same word, it waits for a hypothesis that goes on past it."""
    la = LocalAgreement()
    la.update("to be ill")
    assert la.update("to be ill") == ("to be ill", "to be")
    assert la.update("to be ill-disposed") == ("to be ill-disposed", "to be")
    assert la.update("to be ill-disposed young") == ("to be ill-disposed young", "to be ill-disposed")


def test_case_and_punctuation_insensitive_keeping_spelling() -> None:
    la = LocalAgreement()
    la.update("hello world, how")
    text, stable = la.update("Hello, World how are")
    assert stable == "Hello, World how"  # the newest hypothesis's spelling
    assert text == "Hello, World how are"
    # committed words stay as committed even when later decodes respell them
    assert la.update("hello world. How are you") == ("Hello, World how are you", "Hello, World how are")


def test_never_retracts() -> None:
    la = LocalAgreement()
    la.update("I scream for")
    la.update("I scream for ice")
    assert la.committed == "I scream for"
    # the decoder changes its mind about committed words: they stay, its new words follow
    assert la.update("ice cream for ice cream") == ("I scream for ice cream", "I scream for ice")
    assert la.update("ice cream for ice cream please") == ("I scream for ice cream please", "I scream for ice cream")
    # the final, decoded on the whole segment, is the transcript: it says it revised the committed words
    assert la.finalize("Ice cream, for ice cream, please.") == ("Ice cream, for ice cream, please.", True)


def test_the_final_keeps_or_revises_the_committed_words() -> None:
    la = LocalAgreement()
    la.update("the cat sat on")
    la.update("the cat sat on the")
    assert la.committed == "the cat sat on"
    assert la.finalize("The cat sat on, the mat.") == ("The cat sat on, the mat.", False)  # its spelling
    assert la.finalize("the cold-hearted cat") == ("the cold-hearted cat", True)
    assert la.finalize("And the cat sat on the mat") == ("And the cat sat on the mat", True)  # a word partials missed
    assert la.finalize("the cat") == ("the cat", True)
    assert la.finalize("") == ("the cat sat on", False)  # a final that found nothing erases nothing


def test_numbers_in_words_or_digits_are_the_same_word() -> None:
    la = LocalAgreement()
    la.update("Eight of spades, four")
    assert la.update("8 of spades, 4 of") == ("8 of spades, 4 of", "8 of spades, 4")
    assert la.finalize("Eight of spades, four of clubs, seven of hearts.") == (
        "Eight of spades, four of clubs, seven of hearts.", False)
    assert keys("Forty, fortyish") == ["40", "fortyish"]
    assert keys("twenty-one Ninety-nine.") == ["21", "99"]
    la = LocalAgreement()
    la.update("it costs twenty-one")
    la.update("it costs twenty-one dollars and")
    assert la.finalize("It costs 21 dollars and fifty cents.") == ("It costs 21 dollars and fifty cents.", False)


def test_a_number_spelled_out_in_several_words_is_one_word() -> None:
    """Whisper writes "a hundred and five" in one decode and "105" in the next: the same words,
    not three words against one, so a final that writes them the other way is not `revised` and
    partials that alternate between them still commit what follows."""
    assert keys("a hundred and five") == keys("105") == ["105"]
    assert keys("It was twenty five past two thousand twenty four") == ["it", "was", "25", "past", "2024"]
    assert keys("one two three") == ["1", "2", "3"]  # numbers said one after another stay apart
    assert keys("twelve hundred and a half") == ["1200", "and", "a", "half"]
    assert keys("a cat and a hundred") == ["a", "cat", "and", "100"]
    assert keys("Five thousand, three hundred") == ["5300"]
    la = LocalAgreement()
    la.update("we paid a hundred and five")
    assert la.update("we paid 105 dollars for") == ("we paid 105 dollars for", "we paid 105")
    la.update("we paid a hundred and five dollars for it")
    assert la.committed == "we paid 105 dollars for"
    assert la.finalize("We paid a hundred and five dollars for it.") == ("We paid a hundred and five dollars for it.", False)
    assert la.finalize("We paid a hundred and fifty dollars for it.")[1]  # another number: revised
    la = LocalAgreement()
    la.update("a hundred")
    assert la.update("a hundred and five days") == ("a hundred and five days", "")  # a number still growing is not agreed


def test_words_that_finish_a_committed_number_are_kept() -> None:
    """A number just before the word heard last, which may go on it ("twenty" of "twenty f…":
    "twenty five" or "25"), is held back. Committed words that end in one all the same ("a" of
    "a hundred") are followed by the words completing it, which are not lost from the partial's
    text nor from what is committed after."""
    la = LocalAgreement()
    la.update("it costs twenty")
    assert la.update("it costs twenty f") == ("it costs twenty f", "it costs")
    assert la.update("it costs 25 dollars") == ("it costs 25 dollars", "it costs")
    assert la.update("it costs twenty five dollars") == ("it costs twenty five dollars", "it costs twenty five")
    assert la.update("it costs twenty five dollars each") == ("it costs twenty five dollars each", "it costs twenty five dollars")
    assert la.update("it costs twenty five dollars each day") == (
        "it costs twenty five dollars each day", "it costs twenty five dollars each")
    assert la.finalize("It costs 25 dollars each day.") == ("It costs 25 dollars each day.", False)
    la = LocalAgreement()
    la.update("we waited a")
    la.update("we waited a hun")
    assert la.update("we waited a hundred days") == ("we waited a hundred days", "we waited a")


def test_a_language_written_without_spaces_commits_character_by_character() -> None:
    """Chinese and Japanese have no spaces between words: split on spaces, a partial is one word,
    and the last word is never committed, so nothing would ever be stable. Each character is a
    word; the text keeps no spaces it did not have, and a mix keeps those it had."""
    la = LocalAgreement()
    assert la.update("今天天气") == ("今天天气", "")
    assert la.update("今天天气很好") == ("今天天气很好", "今天天气")
    assert la.update("今天天气很好，我们去") == ("今天天气很好，我们去", "今天天气很好")
    assert la.update("今天天气很好，我们去公园吧。") == ("今天天气很好，我们去公园吧。", "今天天气很好，我们去")
    assert la.finalize("今天天气很好，我们去公园吧。") == ("今天天气很好，我们去公园吧。", False)
    assert la.finalize("明天天气很好，我们去公园吧。") == ("明天天气很好，我们去公园吧。", True)
    la = LocalAgreement()
    la.update("東京 Tower は")
    assert la.update("東京 Tower は高い") == ("東京 Tower は高い", "東京 Tower は")


def test_finals_of_a_language_written_without_spaces_join_without_one() -> None:
    """A stream's transcript is its finals one after another: a space between English ones, none
    between Chinese or Japanese ones (Whisper's own text has none there)."""
    assert joined(["今日はいい天気ですね。", " 公園に行きましょう。"]) == "今日はいい天気ですね。公園に行きましょう。"
    assert joined(["你好", "谢谢"]) == "你好谢谢"
    assert joined(["Go forward.", "", "Turn left."]) == "Go forward. Turn left."
    assert joined(["Das ist 5", "おはよう"]) == "Das ist 5 おはよう"


def test_punctuation_after_the_last_word_does_not_make_it_committable() -> None:
    """Japanese and Chinese end a sentence with "。", a word of its own: the character before it
    is still the last one heard, and may be cut mid-word."""
    la = LocalAgreement()
    la.update("今日は天。")
    assert la.update("今日は天。") == ("今日は天。", "今日は")
    assert la.update("今日は天気です。") == ("今日は天気です。", "今日は天")


def test_vowel_signs_tell_words_apart() -> None:
    """In Devanagari or Thai a vowel is a combining sign on a consonant: "कम" (less) and "काम"
    (work) are different words, and a final with the other one revises the stable text."""
    assert keys("कम") != keys("काम")
    la = LocalAgreement()
    la.update("कम करो")
    assert la.update("कम करो ना") == ("कम करो ना", "कम करो")
    assert la.finalize("काम करो ना") == ("काम करो ना", True)


def test_whitespace_is_normalized() -> None:
    la = LocalAgreement()
    la.update(" Leading  space")
    assert la.update(" Leading space\tand") == ("Leading space and", "Leading space")


WORDS = st.sampled_from(["a", "A", "a,", "cat", "Cat.", "sat", "on", "the", "mat", "mat!", "-", "ice", "cream"])
# numbers spelled out in words join into one word: a prefix may cut one in two
WORDS_AND_NUMBERS = st.one_of(WORDS, st.sampled_from(["one", "hundred", "and", "five", "twenty", "thousand", "105", "20"]))
HYPS = st.lists(st.lists(WORDS_AND_NUMBERS, max_size=12).map(" ".join), min_size=1, max_size=15)


@settings(max_examples=300, deadline=None)
@given(HYPS, st.lists(WORDS_AND_NUMBERS, max_size=12).map(" ".join))
def test_committed_only_grows_and_finalize_keeps_it(hypotheses: list[str], final: str) -> None:
    la = LocalAgreement()
    before: list[str] = []
    for hyp in hypotheses:
        text, stable = la.update(hyp)
        now = stable.split()
        assert now[: len(before)] == before
        assert text.split()[: len(now)] == now
        assert stable == la.committed
        before = now
    text, revised = la.finalize(final)
    if not final.split():
        assert (text, revised) == (la.committed, False)
    else:
        assert text == " ".join(final.split())
        said = keys(text)
        assert revised == (said[: len(keys(" ".join(before)))] != keys(" ".join(before)))


@settings(max_examples=200, deadline=None)
@given(st.lists(WORDS, min_size=1, max_size=20), st.data())
def test_growing_prefixes_commit_all_but_the_newest(words: list[str], data: st.DataObject) -> None:
    """Hypotheses that only ever extend the truth commit it, lagging one hypothesis (and the newest
    hypothesis's last word, with any punctuation after it) behind."""
    cuts = sorted(data.draw(st.lists(st.integers(0, len(words)), min_size=2, max_size=8)))
    la = LocalAgreement()
    for cut in cuts:
        la.update(" ".join(words[:cut]))
    last_word = max((i for i, w in enumerate(words[: cuts[-1]]) if keys(w) != [""]), default=0)
    assert la.committed == " ".join(words[: min(cuts[-2], last_word)])
    assert la.finalize(" ".join(words)) == (" ".join(words), False)
