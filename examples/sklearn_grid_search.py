"""scikit-learn's n_jobs on the memshare backend: X is written to shared memory once per fit call."""

import joblib
from sklearn.datasets import make_classification
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import GridSearchCV

import memshare  # registers the "memshare" joblib backend


def main(n_samples: int = 20_000, n_features: int = 50) -> None:
    X, y = make_classification(n_samples=n_samples, n_features=n_features, random_state=0)  # 8 MB > max_nbytes
    # refit=False: in older scikit-learn (1.2) the refit makes a joblib call of its own, sequential, and
    # last_call_stats() would then describe that call instead of the search's parallel fits.
    search = GridSearchCV(LogisticRegression(max_iter=300), {"C": [0.01, 0.1, 1.0]}, cv=3, n_jobs=-1, refit=False)
    with joblib.parallel_config(backend="memshare"):
        search.fit(X, y)
    stats = memshare.last_call_stats()
    best = LogisticRegression(max_iter=300, **search.best_params_).fit(X, y)
    print(f"best C={best.C}, score={search.best_score_:.3f}")
    written = stats["arrays_dumped"] + stats["arrays_held_once"]
    nbytes = stats["bytes_dumped"] + stats["bytes_held_once"]
    held = stats["arrays_held_once"]
    print(f"arrays written to shared memory: {written} ({nbytes / 2**20:.1f} MiB), {held} of them held once")
    assert written == 1  # X once for the 9 fits (y is small enough to be pickled)


if __name__ == "__main__":
    main()
