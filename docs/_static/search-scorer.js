// The search's ranking (Sphinx's `html_search_scorer`): a query that is exactly a name of the API finds its entry on
// the API page first, then the notebook that explains it, then everything else in Sphinx's own order. docs/prepare.py
// puts `TEACHLOOP_API` before this code: each name of the API -> [its object id on the API page, the notebook that
// explains it].
var Scorer = {
  objNameMatch: 11,
  objPartialMatch: 6,
  objPrio: {0: 15, 1: 5, 2: -5},
  objPrioDefault: 0,
  title: 15,
  partialTitle: 7,
  term: 5,
  partialTerm: 2,

  score: (result) => {
    const [docname, title, anchor, descr, score, filename, kind] = result;
    const query = (new URLSearchParams(window.location.search).get('q') || '').trim().replace(/\(\)$/, '');
    const entry = TEACHLOOP_API[query.replace(/^learn\./, 'Learner.')];
    if (!entry) return score;
    const [id, page] = entry;
    if (kind === 'object' && anchor === '#' + id) return score + 1000;  // its definition
    if (kind === 'object' && title.split('.').pop() === query.split('.').pop()) return score + 500;  // others so named
    if (docname === page) return score + 100;
    return score;
  },
};
