"""The write engine: plan -> execute -> commit, for one process or many, locally or to a URL."""
