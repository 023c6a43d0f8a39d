# The two commands of the README. Each sets up .venv first (fast when already done).
.PHONY: serve test bootstrap

bootstrap:
	./scripts/bootstrap.sh

serve: bootstrap
	.venv/bin/radixserve serve $(ARGS)

# Two pytest workers: alone the suite keeps one of CI's two cores busy on average (user + sys 1.07x its wall time);
# --dist loadscope keeps a module's tests in one worker, so a module's fixtures (a real model, its reference) load once.
TEST_WORKERS ?= 2

test: bootstrap
	.venv/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope $(PYTEST_ARGS)
