# The two commands of the README. Each sets up .venv first (fast when already done).
.PHONY: serve test bootstrap

bootstrap:
	./scripts/bootstrap.sh

serve: bootstrap
	.venv/bin/radixserve serve $(ARGS)

test: bootstrap
	.venv/bin/python -m pytest -q $(PYTEST_ARGS)
