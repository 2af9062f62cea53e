"""scikit-learn's n_jobs on the memshare backend, and Dask pass-through."""

import joblib
import numpy as np
import pytest
from conftest import run_script

import memshare  # noqa: F401  (registers the backend)
from memshare._parent import _held_once

sklearn = pytest.importorskip("sklearn")
from sklearn.datasets import make_classification  # noqa: E402
from sklearn.ensemble import RandomForestClassifier  # noqa: E402
from sklearn.inspection import permutation_importance  # noqa: E402
from sklearn.linear_model import LogisticRegression  # noqa: E402
from sklearn.model_selection import GridSearchCV, cross_val_score  # noqa: E402


@pytest.fixture(scope="module")
def data():
    X, y = make_classification(n_samples=3000, n_features=60, random_state=0)  # X is 1.4 MB > 1M
    return X, y


def run_both(fn):
    with joblib.parallel_config(backend="loky", n_jobs=2):
        reference = fn()
    with joblib.parallel_config(backend="memshare", n_jobs=2):
        ours = fn()
    return reference, ours


def test_grid_search_and_cross_val_match_joblib(data):
    X, y = data

    def grid():
        search = GridSearchCV(LogisticRegression(max_iter=200), {"C": [0.1, 1.0]}, cv=3, n_jobs=-1).fit(X, y)
        return search.best_params_, search.cv_results_["mean_test_score"]

    (ref_params, ref_scores), (params, scores) = run_both(grid)
    assert params == ref_params
    np.testing.assert_allclose(scores, ref_scores)
    ref, ours = run_both(lambda: cross_val_score(LogisticRegression(max_iter=200), X, y, cv=3, n_jobs=-1))
    np.testing.assert_allclose(ours, ref)
    # X went to shared memory: held once (by this call or the grid search's) where glibc gave it a
    # mapping of its own, else dumped.
    assert memshare.last_call_stats()["arrays_dumped"] >= 1 or _held_once.lookup(X) is not None


def test_random_forest_and_permutation_importance_match_joblib(data):
    X, y = data

    def forest():
        model = RandomForestClassifier(n_estimators=8, random_state=0, n_jobs=-1).fit(X, y)
        importance = permutation_importance(model, X[:500], y[:500], n_repeats=2, random_state=0, n_jobs=-1)
        return model.predict_proba(X), importance.importances_mean

    (ref_proba, ref_imp), (proba, imp) = run_both(forest)
    np.testing.assert_allclose(proba, ref_proba)
    np.testing.assert_allclose(imp, ref_imp)


DASK_PASS_THROUGH = """
import distributed, joblib
import numpy as np
import memshare
from memshare import Parallel, delayed

if __name__ == "__main__":
    cluster = distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None)
    with cluster, distributed.Client(cluster), joblib.parallel_config(backend="dask"):
        # joblib registers "dask" when a parallel_config names it.
        out = Parallel()(delayed(np.sum)(np.full(10, i)) for i in range(4))
        shared = memshare.share(np.arange(6.0))
        total = Parallel()(delayed(np.sum)(shared) for _ in range(2))
    print([int(x) for x in out], [float(x) for x in total])
"""


def test_dask_backend_passes_through():
    pytest.importorskip("distributed")
    # In a fresh interpreter: the in-process cluster keeps the tasks' arguments (the shared array among
    # them) past the call, which this process's later "nothing left" checks would count.
    run = run_script(DASK_PASS_THROUGH, timeout=240)
    assert run.stdout.strip().splitlines()[-1] == "[0, 10, 20, 30] [15.0, 15.0]", run.stdout
