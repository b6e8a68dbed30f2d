"""Short common English words for synthetic user text.

Each is a whole token (with its leading space) in the usual BPE vocabularies, so a text of
N words is about N tokens; the tests check the ratio on the real tokenizer when present.
"""

WORDS: tuple[str, ...] = tuple(
    """
    the of and to in is was for on that with as by at from his her they be this have are
    not but had an which one you were all we can their has there been if more when will
    would who so no out up into do than time only about other new some could these two may
    first then any like my now over such our man me even most made after also did many
    before must through back years where much your way well down should because each just
    those people how too little state good very make world still own see men work long get
    here between both life being under never day same another know while last might us
    great old year off come since against go came right used take three small house water
    place hand found part school help line city name river tree light food music game book
    story page road car ship train sun moon star sea rain snow wind fire stone gold red blue
    green black white open close start end plan test data code file user system model
    answer question reason point case group number word table list set order price market
    """.split()
)
