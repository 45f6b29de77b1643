"""The generators of what is derived from the chapter scripts: the published diffs and the README
excerpts, the exercises, the notebooks, the reading map's totals and the results page.

    python -m maintainer.regenerate          # rewrite whatever is stale
    python -m maintainer.regenerate --check  # write nothing; exit 1 if something is stale

Every staleness failure, in these generators and in the tests, prints REGENERATE."""

REGENERATE = "python -m maintainer.regenerate"
