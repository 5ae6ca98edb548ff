"""The single controller: workers, dispatch, worker groups and their Ray and in-process backends."""
