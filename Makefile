# `make demo`: install everything and run EAGLE vs plain decoding on the embedded default model.
# `make test`: install everything (with the test tools) and run the test suite.
PYTHON ?= python

.PHONY: install install-test demo test

install:
	bash scripts/install.sh

install-test:
	bash scripts/install.sh --test

demo: install
	$(PYTHON) -m eagle

test: install-test
	$(PYTHON) -m pytest tests -q -p no:cacheprovider
