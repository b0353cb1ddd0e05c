"""The evaluation text: long documents cut from wikitext to their prose, held out from calibration."""

from kvzip import data

MARKUP = """{{Infobox person|name=Ada|born={{birth date|1815|12|10}}}}
'''Ada Lovelace''' was an English [[mathematician]] known for her work on the [[Analytical Engine|analytical
engine]].<ref name="a">{{cite book|title=X}}</ref> She met [[Charles Babbage]] in 1833.<ref>plain</ref>
[[File:Ada.jpg|thumb|A portrait of [[Ada Lovelace|Ada]]]]
<!-- a comment -->
{| class="wikitable"
| a || {{nested|{{deep}}}}
|}
== Later life ==
: She wrote [http://example.org notes] on the engine.

== References ==
* a citation
[[Category:Mathematicians]]"""


def test_wiki_prose_keeps_the_text_and_drops_the_markup():
    assert data.wiki_prose(MARKUP) == (
        "Ada Lovelace was an English mathematician known for her work on the analytical\n"
        "engine. She met Charles Babbage in 1833.\n\nLater life\nShe wrote notes on the engine.")


def test_long_documents_are_long_prose_held_out_from_calibration():
    docs = data.long_documents()
    assert len(docs) >= 24 and all(len(a) >= len(b) for a, b in zip(docs, docs[1:]))
    assert min(len(d) for d in docs[:24]) > 36_000  # 24 rows of 8,192 tokens at ~4.4 characters a token
    assert not any("{{" in d or "[[" in d or "<ref" in d for d in docs)
    calibration = data.calibration_prose()
    assert not any(d[200:400] in calibration for d in docs)


def test_long_sources_are_long_code_held_out_from_calibration():
    sources = data.long_sources()
    assert len(sources) == len(data.STDLIB_SOURCES) and min(len(s) for s in sources) > 50_000  # 8,192 tokens a row
    assert all("def " in s and "class " in s for s in sources)
    calibration = data.calibration_prose()
    assert not any(s[5000:5200] in calibration for s in sources)
