"""Answer scoring: SQuAD normalization, EM, token F1 and the evidence check, against hand-worked numbers."""

import pytest

from agentrl.envs.search.rewards import exact_match, is_supported, normalize_answer, token_f1


@pytest.mark.parametrize("text, normalized", [
    ("The Eiffel Tower!", "eiffel tower"),
    ("  an   apple, a pear ", "apple pear"),
    ("Theatre", "theatre"),  # 'the' only as a whole word
    ("U.S.A.", "usa"),
    ("", ""),
])
def test_normalize_answer_is_squads(text, normalized):
    assert normalize_answer(text) == normalized


def test_exact_match_against_any_gold():
    assert exact_match("the Paris", ["London", "Paris"]) == 1.0
    assert exact_match("Paris, France", ["Paris"]) == 0.0
    assert exact_match("", ["Paris"]) == 0.0


def test_token_f1_by_hand():
    # pred {paris, france}, gold {paris}: precision 1/2, recall 1/1 -> F1 = 2/3
    assert token_f1("Paris, France", ["Paris"]) == pytest.approx(2 / 3)
    # the best gold counts: vs "city of paris" common=1, p=1/2, r=1/3 -> 0.4; vs "paris france" -> 1
    assert token_f1("Paris France", ["city of Paris", "paris france"]) == pytest.approx(1.0)
    # repeated tokens count with multiplicity: pred [a1, a1], gold [a1] -> common 1, p=1/2, r=1 -> 2/3
    assert token_f1("x x", ["x"]) == pytest.approx(2 / 3)
    assert token_f1("Berlin", ["Paris"]) == 0.0
    assert token_f1("", ["Paris"]) == 0.0


def test_is_supported_needs_whole_words_in_some_evidence():
    evidence = ['"Ilvara Tosk"\nIlvara Tosk was born in the Republic of Andorra.']
    assert is_supported("Andorra", evidence)
    assert is_supported("republic of andorra", evidence)
    assert not is_supported("Andor", evidence)  # a prefix of a word is not support
    assert not is_supported("Paris", evidence)
    assert not is_supported("the", evidence)  # normalizes to nothing
    assert not is_supported("Andorra", [])
