"""``python -m transfer.bench_svm``: an alias of ``python -m benchmarks.svm`` (the benchmark lives in
``benchmarks/``, outside the runtime packages)."""

from benchmarks.svm import main, reference, synthetic_voc_features  # noqa: F401  (re-exported)

if __name__ == "__main__":
    main()
