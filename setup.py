import sys

from setuptools import Extension, find_packages, setup

# The C helper of arrays held once (Linux only). Optional: without a compiler
# memshare installs without it and sends arrays as it did before.
extensions = []
if sys.platform.startswith("linux"):
    extensions.append(Extension("memshare._parent._remap", ["src/memshare/_parent/_remap.c"], optional=True))

with open("README.md", encoding="utf-8") as readme:
    long_description = readme.read()

setup(
    name="memshare",
    version="0.1.0",
    description="Share large NumPy arrays with parallel workers through shared memory instead of copies",
    long_description=long_description,
    long_description_content_type="text/markdown",
    packages=find_packages(where="src", include=["memshare", "memshare.*"]),
    package_dir={"": "src"},
    python_requires=">=3.10",
    ext_modules=extensions,
    install_requires=[
        "numpy>=1.21.2",
        "joblib>=1.3",
        "cloudpickle>=2.0",
        "psutil>=5.8",
        "tqdm>=4.60",
    ],
    extras_require={
        "test": [
            "pytest>=7",
            "pytest-timeout>=2",
            "hypothesis>=6",
            "scikit-learn>=1.2",
            "pandas>=1.5",
            "pyarrow>=10.0.1",
            "polars>=1.36",
            # A CPU build only where these machines have one on disk (the main environment); elsewhere pip
            # would download a CUDA build of several GB, and the torch tests skip, saying why.
            'torch==2.13.0; python_version == "3.11" and platform_machine == "x86_64"',
            "matplotlib>=3.7",
            "scipy>=1.9",
            "dask[distributed]>=2023.1",
            "ruff>=0.5",
        ],
        "bench": ["matplotlib>=3.7", "scikit-learn>=1.2", "pandas>=1.5", "pyarrow>=10.0.1"],
        # What `sphinx-build -W -b html docs <out>` needs: the manual's Markdown pages, numpydoc sections, the theme.
        "docs": ["sphinx>=7", "pydata-sphinx-theme>=0.15", "numpydoc>=1.6", "myst-parser>=3"],
    },
    entry_points={"console_scripts": ["memshare=memshare.__main__:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Operating System :: POSIX :: Linux",
        "License :: OSI Approved :: BSD License",
    ],
)
