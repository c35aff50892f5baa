"""Commands on stored files, with no live target: `report`, `diff` and `growth` over a history store, and `view`
(the web page of a massif.out or a store)."""
